"""verl's Megatron engine with and without tree training (``VERL_ENGINE_VENDOR=megatron_tree``):
one ``train_batch`` (verl's ``ppo_loss``) per repeat, on a GRPO batch and on a low-sharing
multi-hop batch, timed in the same run against two baselines; the speed-ups are printed next to the
FLOP-model ideal.

    .venv-python3.12-0.19.2-verl/bin/python scripts/bench_verl.py [--repeats 3] [--small]

A small random Qwen3 (hidden 256, 4 layers), fp32, one process. On a CPU machine the test
harness's CPU stand-ins are applied. The three engines' steps are interleaved (their order rotating
every repeat), medians after one warm-up each; wall-clock seconds, and the THD ratio also over the
process's CPU seconds, which other jobs on a shared machine inflate less.

The baselines:

* ``verl``: verl's own engine as it runs here. On a CPU that is its padded BSHD path
  (transformer-engine is absent), which computes padding, so the tree's speed-up over it can
  exceed the FLOP-model ideal.
* ``THD``: what verl runs by default on GPUs (remove-padding / THD: no padding, the sequences of a
  micro-batch packed back to back up to the token budget, causal attention within each sequence).
  verl's THD needs transformer-engine, so it is run here by the tree engine with prefix sharing and
  trunk reuse off (``share_prefixes=False``): every sequence a chain of its own, packed to the same
  4,096-token budget, the same model, head and verl loss. Its attention is the package's causal
  path (:func:`~megatron_tree.core.attention.tree_attention` picks ``"causal"`` for chains-only
  micro-batches): on a CPU one torch SDPA call with ``is_causal=True`` per sequence (no mask, but
  one call per sequence), on CUDA in bf16 one FlashAttention varlen call over the micro-batch, as
  verl's THD does. The tree's attention on a CPU is the ``block_sparse`` backend (batched SDPA
  over the allowed tiles), so CPU timings compare two different attention kernels as well as the
  token counts; the FLOP-model ideal (unpacked FLOPs / tree FLOPs, no padding on either side) is
  exactly the ideal against THD. Where the tree is slower than THD the table says so (speed-up
  below 1).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

# The test harness (tests/harness: tiny models, spawned worlds, engine fixtures) is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MODEL = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
)


def rollout(
    groups: list[tuple[torch.Tensor, list[torch.Tensor]]],
) -> tuple[dict, list[torch.Tensor]]:
    """verl's rollout layout for (prompt, responses) groups (the test harness's)."""
    from harness.verl import rollout_layout

    return rollout_layout([(p, r) for p, responses in groups for r in responses])


def grpo_groups(
    vocab: int,
    prompts: int,
    samples: int,
    prompt_len: int,
    response: tuple[int, int],
    seed: int = 0,
):
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(1, vocab, (n,), generator=g)  # noqa: E731
    length = lambda: int(torch.randint(response[0], response[1] + 1, (1,), generator=g))  # noqa: E731
    return [(rand(prompt_len), [rand(length()) for _ in range(samples)]) for _ in range(prompts)]


def multi_hop_groups(vocab: int, sequences: int, shared: int, own: int, seed: int = 1):
    """Low sharing: pairs of sequences share a short system prompt (``shared`` tokens), the rest
    (``own`` tokens of history) is their own; the prompt / response split is at the last quarter."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(1, vocab, (n,), generator=g)  # noqa: E731
    groups = []
    for _ in range(sequences // 2):
        system = rand(shared)
        for _ in range(2):
            history = torch.cat([system, rand(own)])
            cut = len(history) * 3 // 4
            groups.append((history[:cut], [history[cut:]]))
    return groups


def train_step(engine, padded, seqs, *, thd: bool = False):
    """A callable running one ``train_batch`` (verl's ``ppo_loss``) and returning its (wall, CPU)
    seconds; with ``thd`` the tree engine packs chains only (prefix sharing and trunk reuse off),
    the THD baseline of the docstring."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    from harness import verl as harness
    from megatron_tree.integrations import verl_common as adapter
    from megatron_tree.patches._scoped import swapped

    original = adapter.build_packed_tree_batch

    def chains(*args, **kwargs):
        return original(*args, **{**kwargs, "share_prefixes": False, "share_trunks": False})

    mask = padded["response_mask"]
    extra = {"old_log_probs": torch.zeros(mask.shape), "advantages": torch.randn(mask.shape) * mask}
    config = McoreActorConfig(
        strategy="megatron",
        rollout_n=1,
        ppo_mini_batch_size=len(seqs),
        ppo_micro_batch_size_per_gpu=1,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=4096,
    )

    def step() -> tuple[float, float]:
        data = harness.engine_batch(dict(padded, **extra), global_batch_size=len(seqs))
        tu.assign_non_tensor(data, use_dynamic_bsz=True, max_token_len_per_gpu=4096)
        with swapped(adapter, build_packed_tree_batch=chains) if thd else contextlib.nullcontext():
            wall, cpu = time.perf_counter(), time.process_time()
            with engine.train_mode():
                engine.train_batch(data, loss_function=partial(ppo_loss, config=config))
            took = time.perf_counter() - wall, time.process_time() - cpu
        step.stats = getattr(engine, "tree_stats", None)  # this step's packing (tree engines)
        return took

    return step


def interleaved(steps: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds of each step after one warm-up each, the steps interleaved (their
    order rotating every repeat), so a change in the machine's load falls on all of them."""
    for step in steps.values():
        step()
    times = {key: [] for key in steps}
    keys = list(steps)
    for rep in range(repeats):
        for key in keys[rep % len(keys) :] + keys[: rep % len(keys)]:
            times[key].append(steps[key]())
    return {
        key: (statistics.median(t[0] for t in runs), statistics.median(t[1] for t in runs))
        for key, runs in times.items()
    }


def ideal_speedup(model_config, seqs) -> float:
    """Unpacked FLOPs / tree FLOPs of the FLOP model for these sequences (whole tries, no
    padding)."""
    from megatron_tree.core.flops import GPTShape, train_flops
    from megatron_tree.core.packing import build_packed_tree_batch

    hf = model_config.hf_config
    shape = GPTShape(
        hidden=hf.hidden_size,
        layers=hf.num_hidden_layers,
        heads=hf.num_attention_heads,
        query_groups=hf.num_key_value_heads,
        ffn_hidden=hf.intermediate_size,
        vocab=hf.vocab_size,
        head_dim=hf.head_dim,
    )
    trees = build_packed_tree_batch(
        {"input_ids": seqs},
        max_tokens_per_mb=1 << 20,
        block_size=1,
        pad_to_max=False,
        share_trunks=False,
    ).trees
    chains = build_packed_tree_batch(
        {"input_ids": seqs},
        max_tokens_per_mb=1 << 20,
        block_size=1,
        pad_to_max=False,
        share_prefixes=False,
        share_trunks=False,
    ).trees
    return train_flops(chains, shape) / train_flops(trees, shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--small", action="store_true", help="4 x 4 GRPO with 128-token prompts (a quick check)"
    )
    args = parser.parse_args()
    from harness import verl as harness
    from harness.models import make_hf_checkpoint

    if not torch.cuda.is_available():
        harness.setup_cpu()
    path = os.path.join(tempfile.mkdtemp(prefix="bench_verl_"), "qwen3")
    make_hf_checkpoint("qwen3", path, **MODEL)
    prompts, samples, prompt_len = (4, 4, 128) if args.small else (8, 8, 512)
    # The trunk engine's micro-batches are smaller than a prompt group: its prompt runs once as a
    # trunk.
    trunk_tokens = 256 if args.small else 1024
    engines = {
        "verl": harness.build_engine(path, vendor=None),
        "tree": harness.build_engine(path, vendor="megatron_tree", tree_max_tokens=4096),
        "trunk": harness.build_engine(path, vendor="megatron_tree", tree_max_tokens=trunk_tokens),
    }
    vocab = engines["verl"][1].hf_config.vocab_size
    grpo = grpo_groups(vocab, prompts, samples, prompt_len, (64, 256))
    batches = [
        (f"GRPO {prompts}x{samples}, prompt {prompt_len}", grpo, "tree"),
        (f"same, trunk reuse ({trunk_tokens}-token mb)", grpo, "trunk"),
        # pairs sharing 192 of their 288 tokens: a third of the tokens shared
        (
            "multi-hop, low sharing",
            multi_hop_groups(vocab, 2 * prompts, shared=192, own=96),
            "tree",
        ),
    ]
    rows = []
    for name, groups, tree_engine in batches:
        padded, seqs = rollout(groups)
        steps = {key: train_step(engines[key][0], padded, seqs) for key in ("verl", tree_engine)}
        steps["thd"] = train_step(engines["tree"][0], padded, seqs, thd=True)
        measured = interleaved(steps, args.repeats)
        seconds = {key: wall for key, (wall, _) in measured.items()}
        cpu = {key: c for key, (_, c) in measured.items()}
        stats, thd_stats = steps[tree_engine].stats, steps["thd"].stats
        if thd_stats["tree_token_ratio"] != 1.0 or thd_stats["trunk_groups"]:
            raise RuntimeError(f"the THD baseline shared tokens: {thd_stats}")
        shared = 1 - stats["tokens_computed"] / stats["tokens_unpacked"]
        rows.append(
            (
                name,
                len(seqs),
                stats["tokens_unpacked"],
                shared,
                seconds["verl"],
                seconds["thd"],
                seconds[tree_engine],
                seconds["verl"] / seconds[tree_engine],
                seconds["thd"] / seconds[tree_engine],
                cpu["thd"] / cpu[tree_engine],
                ideal_speedup(engines["verl"][1], seqs),
            )
        )
        print(f"[bench] {name}: tree {stats}; THD {thd_stats}", flush=True)
    print(
        f"\n{'batch':<40} {'seqs':>5} {'tokens':>7} {'shared':>7} {'verl s':>8} {'THD s':>8} "
        f"{'tree s':>8} {'vs verl':>8} {'vs THD':>7} {'(CPU s)':>8} {'ideal':>6}"
    )
    for name, n, tokens, shared, base, thd, tree, speedup, vs_thd, vs_thd_cpu, ideal in rows:
        note = "  <- tree slower than THD" if min(vs_thd, vs_thd_cpu) < 1 else ""
        print(
            f"{name:<40} {n:>5} {tokens:>7} {shared:>7.1%} {base:>8.3f} {thd:>8.3f} {tree:>8.3f} "
            f"{speedup:>7.2f}x {vs_thd:>6.2f}x {vs_thd_cpu:>7.2f}x {ideal:>5.2f}x{note}"
        )


if __name__ == "__main__":
    main()
