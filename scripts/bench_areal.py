"""AReaL's log-prob pass (``compute_logp``) and one PPO train step (``ppo_update``: one
``train_batch`` with AReaL's GRPO loss) on a GRPO batch and on a multi-turn agent batch, three
engines in the same run: AReaL 1.0.4 without trees, AReaL's own tree path and megatron_tree's
engine (``TreeMegatronPPOActor``; ``--archon``: AReaL's Archon engine, its own tree path and
``TreeArchonPPOActor``); the speed-ups are printed next to the FLOP-model ideal, with the tokens
each engine computed and its peak memory.

    .venv-python3-areal/bin/python scripts/bench_areal.py [--repeats 3] [--small] [--archon]

A small random Qwen3 (hidden 256, 4 layers), fp32, one process per (engine, batch) so that peak
memory (the process's peak RSS growth over the step, on a CPU; CUDA's peak allocation on a GPU) is
each engine's own. AReaL's tree path builds bf16 parameters when ``dtype="float32"`` without
gradient checkpointing; here its config is rebuilt in fp32 as for the stock engine, so the three
compute in the same precision. On a CPU the test harness's stand-ins are applied
(``harness.areal_platform``); AReaL's tree attention is FlexAttention, which compiles
on the first step (the warm-up). Medians over the repeats after one warm-up; this machine is
noisy, read the ratios.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
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
    max_position_embeddings=16384,  # Archon's rotary table ends here; GRPO rows pass 512
)
ENGINES = ("AReaL", "AReaL tree", "megatron_tree")
ARCHON_ENGINES = ("Archon", "Archon tree", "megatron_tree")


def batches(small: bool, vocab: int) -> dict[str, list[torch.Tensor]]:
    """name -> (sequences, prompt lengths): a GRPO batch and a multi-turn agent batch."""
    from megatron_tree.testing.synthetic import grpo_batch, multi_turn_batch

    if small:
        grpo = grpo_batch(num_prompts=2, samples_per_prompt=4, prompt_len=128, vocab_size=vocab)
        agent = multi_turn_batch(
            num_tasks=2, rollouts_per_task=2, turns=2, system_len=64, task_len=32, vocab_size=vocab
        )
    else:
        grpo = grpo_batch(num_prompts=4, samples_per_prompt=8, prompt_len=512, vocab_size=vocab)
        agent = multi_turn_batch(num_tasks=2, rollouts_per_task=4, turns=3, vocab_size=vocab)
    out = {}
    for name, batch in (("GRPO", grpo), ("multi-turn agent", agent)):
        lengths = batch["attention_mask"].sum(-1).tolist()
        seqs = [ids[:n] for ids, n in zip(batch["input_ids"], lengths)]
        prompts = [int((mask[:n] == 0).sum()) for mask, n in zip(batch["loss_mask"], lengths)]
        out[name] = (seqs, prompts)
    return out


def _peak_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _step_worker(
    rank: int, path: str, engine: str, archon: bool, seqs, prompts, repeats: int, mb_tokens: int
):
    """One engine's median ``compute_logp`` and ``ppo_update`` seconds, tokens computed and peak
    memory growth."""
    eng = _build(engine, archon, path, mb_tokens)
    from areal.utils import stats_tracker

    from harness import areal as harness

    trajectories = harness.areal_trajectories(seqs, prompt_lens=prompts)
    out = {"dtypes": harness.parameter_dtypes(eng) if not archon else None}
    base = _peak_bytes()
    forward, train = [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        eng.compute_logp([dict(t) for t in trajectories])
        forward.append(time.perf_counter() - t0)
        stats = stats_tracker.export_all()
    out["forward_s"] = statistics.median(forward[1:])
    real = sum(len(s) for s in seqs)
    ratio = stats.get("tree_token_ratio", 1.0)  # AReaL's tree path and ours report it
    out["tokens"] = round(real * ratio)
    if engine.endswith(" tree") and not torch.cuda.is_available():
        # FlexAttention has no backward on the CPU ("FlexAttention does not support backward on
        # CPU"): AReaL's tree path cannot train here.
        out["train_s"] = None
    else:
        for _ in range(repeats + 1):
            batch = eng.compute_advantages([dict(t) for t in trajectories])
            t0 = time.perf_counter()
            eng.ppo_update(batch)
            train.append(time.perf_counter() - t0)
            stats_tracker.export_all()
        out["train_s"] = statistics.median(train[1:])
    out["peak_mib"] = (_peak_bytes() - base) / 2**20
    eng.destroy()
    return out


def _build(engine: str, archon: bool, path: str, mb_tokens: int):
    """The engine named ``engine`` of AReaL's Megatron engines (``archon``: its Archon engines)."""
    if archon:
        from harness import areal_archon

        if not torch.cuda.is_available():
            areal_archon.setup_archon_cpu()
        from areal.experimental.engine import archon_engine
        from areal.utils.constants import DEFAULT_PAGE_SIZE_BYTES

        from megatron_tree.integrations.areal_archon import TreeArchonPPOActor

        archon_engine.DEFAULT_PAGE_SIZE_BYTES = DEFAULT_PAGE_SIZE_BYTES  # Archon's own padding
        stock_attention = "varlen" if torch.cuda.is_available() else "sdpa"  # flash-attn: CUDA
        options = {
            "Archon": dict(archon={"attn_type": stock_attention}),
            "Archon tree": dict(tree=True),
            "megatron_tree": dict(tree=True, engine_cls=TreeArchonPPOActor),
        }[engine]
        return areal_archon.build_archon_engine(path, mb_tokens=mb_tokens, **options)
    from harness import areal_platform

    if not torch.cuda.is_available():
        areal_platform.setup_cpu()
    from harness import areal as harness
    from megatron_tree.integrations.areal import TreeMegatronPPOActor

    if engine == "AReaL tree":
        return _areal_tree_fp32(harness, path, mb_tokens)
    ours = dict(tree=True, engine_cls=TreeMegatronPPOActor)
    options = ours if engine == "megatron_tree" else dict(fp32_params=True)
    return harness.build_areal_engine(path, mb_tokens=mb_tokens, **options)


def _areal_tree_fp32(harness, path: str, mb_tokens: int):
    """AReaL's own tree engine with its mbridge config rebuilt in fp32 (the harness refuses
    ``fp32_params`` for it, as a test must not hide the bf16 default; a benchmark compares like with
    like)."""
    import areal.engine.megatron_engine as engine_module

    build = engine_module.MegatronEngine._build_hf_mcore_bridge

    def fp32_bridge(self):
        bridge = build(self)
        bridge.set_extra_args()  # rebuilt from bridge.dtype (fp32)
        return bridge

    engine_module.MegatronEngine._build_hf_mcore_bridge = fp32_bridge
    try:
        eng = harness.build_areal_engine(path, tree=True, mb_tokens=mb_tokens)
    finally:
        engine_module.MegatronEngine._build_hf_mcore_bridge = build
    assert harness.parameter_dtypes(eng) == {torch.float32}
    return eng


def ideal_speedup(seqs: list[torch.Tensor], vocab: int) -> float:
    """Unpacked FLOPs / tree FLOPs of the FLOP model for these sequences (whole tries, no
    padding)."""
    from megatron_tree.core.flops import GPTShape, train_flops
    from megatron_tree.core.packing import build_packed_tree_batch

    shape = GPTShape(
        hidden=MODEL["hidden_size"],
        layers=MODEL["num_hidden_layers"],
        heads=MODEL["num_attention_heads"],
        query_groups=MODEL["num_key_value_heads"],
        ffn_hidden=MODEL["intermediate_size"],
        vocab=vocab,
        head_dim=MODEL["head_dim"],
    )

    def trees(share: bool):
        return build_packed_tree_batch(
            {"input_ids": seqs},
            max_tokens_per_mb=1 << 20,
            block_size=1,
            share_prefixes=share,
            share_trunks=False,
        ).trees

    return train_flops(trees(False), shape) / train_flops(trees(True), shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="small batches (a quick check)")
    parser.add_argument("--mb-tokens", type=int, default=8192, help="max_tokens_per_mb")
    parser.add_argument("--archon", action="store_true", help="AReaL's Archon engines")
    args = parser.parse_args()
    engines = ARCHON_ENGINES if args.archon else ENGINES
    from transformers import AutoConfig

    from harness.dist import run_spawned
    from harness.models import make_hf_checkpoint

    path = os.path.join(tempfile.mkdtemp(prefix="bench_areal_"), "qwen3")
    make_hf_checkpoint("qwen3", path, **MODEL)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    rows = []
    for name, (seqs, prompts) in batches(args.small, vocab).items():
        results = {}
        for engine in engines:
            results[engine] = run_spawned(
                _step_worker,
                1,
                path,
                engine,
                args.archon,
                seqs,
                prompts,
                args.repeats,
                args.mb_tokens,
                megatron=False,
            )[0]
            print(f"[bench] {name}, {engine}: {results[engine]}", flush=True)
        rows.append(
            (name, len(seqs), sum(len(s) for s in seqs), results, ideal_speedup(seqs, vocab))
        )
    print(
        f"\n{'batch':<18} {'seqs':>5} {'tokens':>7} {'engine':<14} {'computed':>9} "
        f"{'fwd s':>7} {'vs stock':>9} {'train s':>8} {'vs stock':>9} {'ideal':>6} {'peak MiB':>9}"
    )
    for name, n, tokens, results, ideal in rows:
        base = results[engines[0]]
        for engine in engines:
            r = results[engine]
            train = "n/a" if r["train_s"] is None else f"{r['train_s']:.3f}"
            train_x = "n/a" if r["train_s"] is None else f"{base['train_s'] / r['train_s']:.2f}x"
            print(
                f"{name:<18} {n:>5} {tokens:>7} {engine:<14} {r['tokens']:>9} "
                f"{r['forward_s']:>7.3f} {base['forward_s'] / r['forward_s']:>8.2f}x {train:>8} "
                f"{train_x:>9} {ideal:>5.2f}x {r['peak_mib']:>9.0f}"
            )
    print(
        "stock: AReaL's engine without trees (Archon's: packed SDPA on a CPU). n/a: AReaL's tree "
        "paths train through FlexAttention, which has no backward on a CPU. "
        "ideal: the FLOP model's unpacked / tree FLOPs (training)."
    )


if __name__ == "__main__":
    main()
