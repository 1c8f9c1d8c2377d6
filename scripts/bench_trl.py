"""TRL 1.16's GRPO log-prob pass and loss step, stock ``GRPOTrainer`` against ``TreeGRPOTrainer``,
on one GRPO batch: ``_get_per_token_logps_and_entropies`` under no_grad (the old / reference
log-probs) and ``compute_loss`` + backward (the training step's model work), with the tokens each
computes and the FLOP model's ideal speed-up.

    .venv-python3-trl/bin/python scripts/bench_trl.py [--repeats 3] [--prompts 2] [--samples 8]

A small random Qwen3 (hidden 256, 4 layers, vocabulary 128), fp32, CPU, one process; medians over
the repeats after one warm-up. This machine is shared and noisy: read the ratios.
"""

from __future__ import annotations

import argparse
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
    max_position_embeddings=4096,
)


def grpo_rows(prompts: int, samples: int, prompt_len: int, seed: int = 0):
    """``prompts`` random prompts of ``prompt_len`` tokens, each with ``samples`` random responses
    of 64-128 tokens: (prompt per row, response per row)."""
    from harness.models import VOCAB

    g = torch.Generator().manual_seed(seed)
    rows_p, rows_c = [], []
    for _ in range(prompts):
        prompt = torch.randint(3, VOCAB, (prompt_len,), generator=g)
        for _ in range(samples):
            n = int(torch.randint(64, 129, (), generator=g))
            rows_p.append(prompt)
            rows_c.append(torch.randint(3, VOCAB, (n,), generator=g))
    return rows_p, rows_c


def ideal_speedup(seqs: list[torch.Tensor], vocab: int) -> float:
    """Unpacked FLOPs / tree FLOPs of the FLOP model (whole tries, no padding)."""
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


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    args = parser.parse_args()

    from harness.models import VOCAB, make_hf_checkpoint
    from harness.trl import grpo_trainer, prompt_completion, trl_inputs
    from megatron_tree import build_packed_tree_batch
    from megatron_tree.integrations.transformers import TreeAttentionOptions

    torch.manual_seed(0)
    prompts, completions = grpo_rows(args.prompts, args.samples, args.prompt_len)
    inputs = trl_inputs(prompts, completions, num_generations=args.samples)
    ids, mask, keep = prompt_completion(inputs)
    seqs = [torch.cat([p, c]) for p, c in zip(prompts, completions)]
    packed = build_packed_tree_batch(
        {"input_ids": seqs}, max_tokens_per_mb=1 << 20, block_size=128, share_trunks=False
    )
    print(
        f"batch: {args.prompts} prompts x {args.samples}, prompt {args.prompt_len}: "
        f"{len(seqs)} rows, {packed.num_real_tokens} tokens; stock computes {ids.numel()} (padded "
        f"[{ids.shape[0]}, {ids.shape[1]}]), trees {packed.num_padded_tokens}; FLOP-model ideal "
        f"{ideal_speedup(seqs, VOCAB):.2f}x"
    )
    with tempfile.TemporaryDirectory() as tmp:
        make_hf_checkpoint("qwen3", f"{tmp}/model", **MODEL)
        rows = {}
        for tree in (False, True):
            trainer = grpo_trainer(
                f"{tmp}/model",
                f"{tmp}/{tree}",
                tree=tree,
                prompts=[f"p{i}" for i in range(args.prompts)],
                num_generations=args.samples,
                reward=lambda completions, **kw: [0.0] * len(completions),
                tree_options=TreeAttentionOptions() if tree else None,
            )
            model = trainer.model

            def logps(trainer=trainer, model=model):
                with torch.no_grad():
                    trainer._get_per_token_logps_and_entropies(model, ids, mask, keep)

            def step(trainer=trainer, model=model):
                model.zero_grad(set_to_none=True)
                trainer.compute_loss(model, inputs).backward()

            rows[tree] = (timed(logps, args.repeats), timed(step, args.repeats))
    (lp0, st0), (lp1, st1) = rows[False], rows[True]
    print("| trainer | log-probs (no_grad) s | vs stock | compute_loss + backward s | vs stock |")
    print("|---|---|---|---|---|")
    print(f"| GRPOTrainer | {lp0:.2f} | 1.00x | {st0:.2f} | 1.00x |")
    print(f"| TreeGRPOTrainer | {lp1:.2f} | {lp0 / lp1:.2f}x | {st1:.2f} | {st0 / st1:.2f}x |")


if __name__ == "__main__":
    main()
