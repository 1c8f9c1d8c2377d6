"""Benchmark: forward+backward of a small GPT on tree-packed vs. unshared packed micro-batches.

Same model, same tree attention kernels; the baseline packs the same sequences with sharing switched
off (every sequence its own root: positions 0..L-1, each token sees its own sequence's prefix).
The speed-up is reported next to the ideal from the package's FLOP model
(``megatron_tree.core.flops``: linear layers scale with packed tokens, attention with the number of
allowed (query, key) pairs, read off ``subtree_end``).

Two batches are timed: a GRPO batch (one prompt, n responses: everything shared) and a batch of n
unrelated sequences of the same lengths (nothing shared, where tree packing must cost nothing).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_model.py            # CPU defaults
    python scripts/bench_model.py --device cuda --dtype bf16 --backend flex --hidden 1024 --layers 8
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

# The test harness (tests/harness: tiny models, spawned worlds, engine fixtures) is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--groups", type=int, default=2, help="key/value groups (GQA)")
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--responses", type=int, default=8)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument(
        "--backend", default="block_sparse", choices=["auto", "sdpa", "flex", "block_sparse"]
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")))
    return p.parse_args(argv)


def init_world():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    from megatron_tree.patches import megatron_cpu

    megatron_cpu.apply()  # no-op on CUDA machines
    if not dist.is_initialized():
        init = f"file://{tempfile.mkdtemp()}/rendezvous"  # a one-process world: no port to race for
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    mp_random.model_parallel_cuda_manual_seed(1234)


def build_model(args):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from harness.models import small_gpt_config
    from megatron_tree.mcore.model import TreeGPTModel
    from megatron_tree.mcore.spec import tree_attention_spec

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = small_gpt_config(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.groups,
        ffn_hidden_size=args.ffn,
        params_dtype=dtype,
        bf16=args.dtype == "bf16",
    )
    spec = tree_attention_spec(
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        backend=args.backend,
        block_size=args.block_size,
    )
    model = TreeGPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab,
        max_sequence_length=args.prompt + args.response_len,
        position_embedding_type="rope",
    )
    return model.to(device=args.device, dtype=dtype)


def batches(args):
    """(shared GRPO sequences, unrelated sequences of the same lengths)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, args.vocab, (args.prompt,), generator=g)
    shared = [
        torch.cat([prompt, torch.randint(1, args.vocab, (args.response_len,), generator=g)])
        for _ in range(args.responses)
    ]
    unrelated = [
        torch.randint(1, args.vocab, (args.prompt + args.response_len,), generator=g)
        for _ in range(args.responses)
    ]
    return shared, unrelated


def packed_micro_batch(seqs, args, *, share_prefixes: bool) -> dict:
    """All of ``seqs`` in one micro-batch; ``share_prefixes=False`` is the unshared baseline
    (every sequence its own root chain, same packing code and kernels)."""
    from megatron_tree.core.packing import build_packed_tree_batch
    from megatron_tree.testing.synthetic import pad_sequences

    total = sum(len(s) for s in seqs)
    cap = -(-total // args.block_size) * args.block_size
    mbs = build_packed_tree_batch(
        pad_sequences(seqs),
        max_tokens_per_mb=cap,
        block_size=args.block_size,
        pad_to_max=False,
        share_prefixes=share_prefixes,
    )
    assert len(mbs) == 1
    mb = mbs[0]
    return {"input_ids": mb["input_ids"], "position_ids": mb["position_ids"], "tree": mb["tree"]}


def step_inputs(mb, device):
    """Model inputs plus the (position, target) pairs of every sequence's next-token loss."""
    tree = mb["tree"]
    idx = tree.token_index
    last = tree.cu_seqlens[1:] - 1
    keep = torch.ones(len(idx), dtype=torch.bool)
    keep[last] = False
    positions = idx[keep]
    targets = tree.input_ids[idx[torch.nonzero(keep).squeeze(1) + 1]]
    return (
        mb["input_ids"].to(device),
        mb["position_ids"].to(device),
        tree.subtree_end.to(device),  # a fresh TreeMask per step: its plan is built inside the step
        positions.to(device),
        targets.to(device),
    )


def make_step(model, inputs):
    input_ids, position_ids, mask, positions, targets = inputs

    def step():
        from megatron_tree.core.mask import tree_attention_mask

        model.zero_grad(set_to_none=True)
        logits = model(input_ids, position_ids, attention_mask=tree_attention_mask(mask))[0]
        logp = torch.log_softmax(logits[positions].float(), dim=-1)
        loss = -logp.gather(1, targets[:, None]).mean()
        loss.backward()

    return step


def time_steps(steps: dict, reps: int, device: str) -> dict:
    """Best-of-``reps`` seconds per step, the steps interleaved so that load from other processes on
    a shared machine hits all of them alike."""
    for step in steps.values():
        step()  # warm-up
    times = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    return {name: min(t) for name, t in times.items()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    init_world()
    from megatron_tree.core.flops import GPTShape, train_flops

    model = build_model(args).train()
    shape = GPTShape.from_config(model.config, args.vocab)
    shared, unrelated = batches(args)
    rows = {}
    for name, seqs in (("shared (GRPO)", shared), ("nothing shared", unrelated)):
        tree_mb = packed_micro_batch(seqs, args, share_prefixes=True)
        base_mb = packed_micro_batch(seqs, args, share_prefixes=False)
        times = time_steps(
            {
                "tree": make_step(model, step_inputs(tree_mb, args.device)),
                "base": make_step(model, step_inputs(base_mb, args.device)),
            },
            args.reps,
            args.device,
        )
        t_tree, t_base = times["tree"], times["base"]
        ideal = train_flops([base_mb["tree"]], shape) / train_flops([tree_mb["tree"]], shape)
        rows[name] = dict(
            tokens_tree=tree_mb["tree"].num_tree_tokens,
            tokens_base=base_mb["tree"].num_tree_tokens,
            t_tree=t_tree,
            t_base=t_base,
            speedup=t_base / t_tree,
            ideal=ideal,
        )
    print(
        f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.groups} "
        f"groups, ffn {args.ffn}, vocab {args.vocab}; {args.device} {args.dtype}, backend "
        f"{args.backend}, threads {args.threads}; batch: prompt {args.prompt} + {args.responses} x "
        f"{args.response_len}"
    )
    print(
        f"{'batch':<16} {'tokens tree/base':>17} {'fwd+bwd tree':>13} {'baseline':>9} "
        f"{'speed-up':>9} {'ideal':>6} {'of ideal':>9}"
    )
    for name, r in rows.items():
        print(
            f"{name:<16} {r['tokens_tree']:>8}/{r['tokens_base']:<8} {r['t_tree']:>12.3f}s "
            f"{r['t_base']:>8.3f}s {r['speedup']:>8.2f}x {r['ideal']:>5.2f}x "
            f"{r['speedup'] / r['ideal']:>8.0%}"
        )
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
