"""Trunk reuse benchmark on the CPU: tokens, FLOPs, step time and peak memory of one agent batch.

    .venv/bin/python scripts/bench_trunk.py [--repeats 5] [--skip-unshared] [--capacity 8192]
                                            [--hidden 128] [--layers 2] [--seed 4] [--threads 1]

The batch: one 1500-token system prompt shared by 10 tasks, 4 multi-turn rollouts per task
(``multi_turn_batch``; ~390K tokens, ~35K unique), too large for one micro-batch of ``--capacity``
tokens. Three packings are compared (all ``pad_to_max=False``):

* unshared:  ``share_prefixes=False`` (every sequence its own chain, same kernels);
* tree:      tree packing today (``share_trunks=False``): the trie is cut at branch points and the
             shared prefix is recomputed in every micro-batch holding a piece of it;
* trunk:     trunk reuse (``share_trunks=True``): the trunk runs once, branches attend to its keys
             and values.

It prints (1) a packing table: micro-batches, tokens computed, padded tokens, tokens over the
single-trie unique-token count (counted here by sorting, independently of the packer) and the FLOP
model's forward+backward cost (``GPTShape`` of the benchmark model; "ideal" = one trie holding every
sequence); (2) the trunk-reuse layout; (3) the median training-step time (forward + backward) of a
small dense GPT in Megatron's single-process CPU world, tree and trunk timed alternately; (4) the
peak-memory growth of one step per mode, each in a fresh subprocess (``ru_maxrss`` after the step
minus before it; measured first, as a child inherits its parent's ``ru_maxrss`` through exec);
(5) PASS/FAIL of the goals (trunk tokens within 10% of the single trie; trunk step >= 1.25x faster
than tree packing). Timings are reported, never asserted. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from megatron_tree.core.flops import GPTShape
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.testing.synthetic import multi_turn_batch

BATCH = dict(num_tasks=10, rollouts_per_task=4, turns=(3, 7), system_len=1500, task_len=200,
             observation_len=(40, 140), action_len=(50, 150))
MODES = {
    "unshared": dict(share_prefixes=False, share_trunks=False),
    "tree": dict(share_prefixes=True, share_trunks=False),
    "trunk": dict(share_prefixes=True, share_trunks=True),
}
VOCAB, BLOCK = 1024, 128
# An 8B-class shape (Llama-3-8B): the FLOP model's speed-up where linear layers outweigh attention,
# unlike the CPU model, whose attention over 1.5-3K-token contexts dominates.
LARGE = GPTShape(hidden=4096, layers=32, heads=32, query_groups=8, ffn_hidden=14336, vocab=128256)


def log(msg: str) -> None:
    print(f"[bench_trunk {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_batch(seed: int) -> dict:
    """The agent batch with the per-token inputs of a PPO step (loss mask rolled: entry t is about
    token t + 1, so it marks the entries that predict generated tokens)."""
    batch = multi_turn_batch(**BATCH, vocab_size=VOCAB, seed=seed)
    b, width = batch["input_ids"].shape
    generated = batch["loss_mask"]
    batch["loss_mask"] = torch.cat([generated[:, 1:], torch.zeros(b, 1)], dim=1)
    g = torch.Generator().manual_seed(seed)
    batch["old_logprobs"] = -3 * torch.rand(b, width, generator=g) - 3.5
    batch["advantages"] = torch.randn(b, 1, generator=g).expand(b, width).contiguous()
    return batch


def unique_prefix_count(batch: dict) -> int:
    """Distinct prefixes over all sequences (the single trie's nodes): sort the sequences; each adds
    its length minus its longest common prefix with its predecessor."""
    lengths = batch["attention_mask"].sum(1).tolist()
    seqs = sorted(tuple(row[:n].tolist()) for row, n in zip(batch["input_ids"], lengths))
    total, prev = 0, ()
    for seq in seqs:
        common = 0
        for a, b in zip(prev, seq):
            if a != b:
                break
            common += 1
        total += len(seq) - common
        prev = seq
    return total


def pack(batch: dict, capacity: int, mode: str):
    return build_packed_tree_batch(batch, max_tokens_per_mb=capacity, block_size=BLOCK, pad_to_max=False,
                                   **MODES[mode])


def config_for(args):
    from megatron_tree.testing.models import small_gpt_config

    return small_gpt_config(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4,
                            num_query_groups=2, ffn_hidden_size=4 * args.hidden)


def build_model(args):
    from megatron_tree.testing.dist import single_process_world
    from megatron_tree.testing.models import build_gpt_model

    single_process_world()  # applies the CPU patch (megatron_tree.patches.megatron_cpu)
    return build_gpt_model(config_for(args), tree=True, vocab_size=VOCAB, backend="block_sparse", block_size=BLOCK)


def train_step(model, packed) -> float:
    """One forward + backward of a packed batch (gradients zeroed first); seconds."""
    from megatron_tree.core.heads import LogProbs
    from megatron_tree.core.losses import ppo_clipped_loss
    from megatron_tree.mcore.step import tree_forward_backward

    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    tree_forward_backward(model, packed, lambda out, mb: ppo_clipped_loss(out, mb, clip_eps=0.2, entropy_coef=0.01),
                          gather=LogProbs())
    return time.perf_counter() - t0


def child(args) -> None:
    """One step of ``args.child`` in this fresh process; prints {"mib": peak RSS growth} as JSON."""
    model = build_model(args)
    packed = pack(make_batch(args.seed), args.capacity, args.child)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    train_step(model, packed)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"mib": (after - before) / 1024, "before_mib": before / 1024}))


def packing_table(batch, args, modes, shape):
    """Prints the packing table; returns ({mode: packed}, unique count, {mode: (cost, 8B cost)})."""
    unique = unique_prefix_count(batch)
    total = int(batch["attention_mask"].sum())
    print(f"batch: {batch['input_ids'].shape[0]} sequences, {total} tokens, {unique} unique "
          f"(single-trie count), longest {int(batch['attention_mask'].sum(1).max())}")
    ideal = build_packed_tree_batch(batch, max_tokens_per_mb=-(-total // BLOCK) * BLOCK, block_size=BLOCK,
                                    pad_to_max=False, share_trunks=False)
    packed, costs = {}, {}
    print(f"\n1. packing, capacity {args.capacity}; FLOP model (fwd+bwd) of the CPU model "
          f"({shape.hidden}h x {shape.layers}L) and of an 8B-class model")
    print(f"{'mode':10} {'micro-b':>7} {'tokens':>8} {'padded':>8} {'/unique':>8} {'GFLOP':>9} {'/ideal':>7} "
          f"{'8B TFLOP':>9} {'/ideal':>7}")
    for name in ["ideal"] + modes:
        if name == "ideal":
            p = ideal
        else:
            log(f"packing {name}")
            p = packed[name] = pack(batch, args.capacity, name)
        costs[name] = (sum(p.tree_costs(shape)), sum(p.tree_costs(LARGE)))
        ratio = [c / i for c, i in zip(costs[name], costs["ideal"])]
        print(f"{name:10} {len(p):7d} {p.num_tree_tokens:8d} {p.num_padded_tokens:8d} "
              f"{p.num_tree_tokens / unique:8.3f} {costs[name][0] / 1e9:9.1f} {ratio[0]:7.3f} "
              f"{costs[name][1] / 1e12:9.1f} {ratio[1]:7.3f}")
    return packed, unique, costs


def print_layout(packed) -> None:
    print("\n2. trunk-reuse layout (rows real/padded, sequences whose loss the micro-batch takes)")
    for i, mb in enumerate(packed):
        part = mb.get("part")
        if part is None:
            tree = mb["tree"]
            print(f"  mb {i}: plain tree  rows {tree.num_tree_tokens}/{tree.padded_length}, {tree.num_sequences} seqs")
        else:
            kind = "trunk " if part.is_trunk else f"branch {part.index}"
            print(f"  mb {i}: group {part.group} {kind:9} rows {part.num_real}/{part.num_rows}, "
                  f"{mb['tree'].num_sequences} seqs, depth <= {part.max_depth}")


def time_steps(packed, args) -> dict:
    log("building the model")
    model = build_model(args)
    times = {"tree": [], "trunk": []}
    for mode in times:  # warm-up, one each
        log(f"warm-up step: {mode}")
        train_step(model, packed[mode])
    for r in range(args.repeats):
        for mode in times:
            times[mode].append(train_step(model, packed[mode]))
        log(f"repeat {r + 1}/{args.repeats}: tree {times['tree'][-1]:.2f} s, trunk {times['trunk'][-1]:.2f} s")
    if not args.skip_unshared:
        times["unshared"] = []
        for r in range(args.unshared_repeats):
            log(f"unshared step {r + 1}/{args.unshared_repeats}")
            times["unshared"].append(train_step(model, packed["unshared"]))
            log(f"unshared step: {times['unshared'][-1]:.2f} s")
    paired = statistics.median(a / b for a, b in zip(times["tree"], times["trunk"]))
    return {mode: statistics.median(t) for mode, t in times.items()}, paired


def peak_memory(mode: str, args) -> dict:
    """Run before this process grows: a child inherits its parent's ru_maxrss through exec."""
    log(f"peak memory: one {mode} step in a fresh process")
    parent = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    cmd = [sys.executable, __file__, "--child", mode, "--threads", str(args.threads), "--capacity", str(args.capacity), "--hidden",
           str(args.hidden), "--layers", str(args.layers), "--seed", str(args.seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise RuntimeError(f"the {mode} memory child failed (exit {proc.returncode})")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["before_mib"] <= parent:  # the child's baseline may be the parent's inherited peak
        log(f"warning: {mode} child's RSS before the step <= this process's peak ({parent:.0f} MiB)")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per mode (tree, trunk), alternating")
    parser.add_argument("--unshared-repeats", type=int, default=1, help="timed steps of the unshared baseline")
    parser.add_argument("--skip-unshared", action="store_true", help="no step time or memory of the baseline")
    parser.add_argument("--capacity", type=int, default=8192, help="max_tokens_per_mb")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=4, help="seed of the synthetic batch")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: on this shared 2-core machine two threads made "
                             "step times vary by up to 1.5x from run to run)")
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        return child(args)

    modes = [m for m in MODES if not (args.skip_unshared and m == "unshared")]
    memory = {mode: peak_memory(mode, args) for mode in modes}  # first, while this process is small
    config = config_for(args)
    shape = GPTShape.from_config(config, VOCAB)
    print(f"model: {args.layers} layers, hidden {args.hidden}, 4 heads / 2 query groups, FFN {4 * args.hidden}, "
          f"vocab {VOCAB}, block_sparse tiles of {BLOCK}; torch threads {torch.get_num_threads()}")
    log("building the batch")
    batch = make_batch(args.seed)
    packed, unique, costs = packing_table(batch, args, list(MODES), shape)
    print_layout(packed["trunk"])

    seconds, paired = time_steps(packed, args)
    print(f"\n3. training step (forward + backward), median of {args.repeats} alternating runs after a warm-up")
    for mode, s in seconds.items():
        print(f"  {mode:9} {s:8.2f} s   x{s / seconds['trunk']:.2f} of trunk reuse"
              + ("  (median of %d)" % args.unshared_repeats if mode == "unshared" else ""))

    print("\n4. peak RSS growth of one training step (fresh process; ru_maxrss after - before the step)")
    for mode, m in memory.items():
        print(f"  {mode:9} {m['mib']:8.1f} MiB   (RSS before the step {m['before_mib']:.0f} MiB)")

    over = packed["trunk"].num_tree_tokens / unique
    speedup = seconds["tree"] / seconds["trunk"]
    print("\n5. goals")
    print(f"  [{'PASS' if over <= 1.10 else 'FAIL'}] trunk-reuse tokens {packed['trunk'].num_tree_tokens} within 10% "
          f"of the single trie's {unique} (x{over:.3f})")
    flops = [t / r for t, r in zip(costs["tree"], costs["trunk"])]
    print(f"  FLOP model, tree / trunk: x{flops[0]:.3f} on the CPU model, x{flops[1]:.3f} on the 8B-class model "
          f"(tokens x{packed['tree'].num_tree_tokens / packed['trunk'].num_tree_tokens:.3f})")
    print(f"  [{'PASS' if speedup >= 1.25 else 'FAIL'}] trunk-reuse step x{speedup:.3f} faster than tree packing "
          f"(goal >= 1.25; tree {seconds['tree']:.2f} s, trunk {seconds['trunk']:.2f} s; median of the "
          f"{args.repeats} paired ratios x{paired:.3f})")


if __name__ == "__main__":
    main()
