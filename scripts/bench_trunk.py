"""Trunk reuse benchmark on the CPU: tokens, FLOPs, step time and peak memory of one agent batch.

    .venv/bin/python scripts/bench_trunk.py [--repeats 5] [--skip-unshared] [--capacity 8192]
                                            [--hidden 128] [--layers 2] [--seed 4] [--threads 1]
                                            [--layout pp1|cp2|pp2]

The batch: one 1500-token system prompt shared by 10 tasks, 4 multi-turn rollouts per task
(``multi_turn_batch``; ~390K tokens, ~35K unique), too large for one micro-batch of ``--capacity``
tokens. Three packings are compared (all ``pad_to_max=False``):

* unshared:  ``share_prefixes=False`` (every sequence its own chain, same kernels);
* tree:      tree packing today (``share_trunks=False``): the trie is cut at branch points and the
             shared prefix is recomputed in every micro-batch holding a piece of it;
* trunk:     trunk reuse (``share_trunks=True``): the trunk runs once, branches attend to its keys
             and values (the one schedule's three phases: a no-grad trunk pass, the branches, the
             trunk recomputed; one micro-batch's activations at a time).

``--layout cp2`` / ``pp2`` run tree packing and trunk reuse on a 2-process gloo world (context
parallelism 2, or pipeline parallelism 2 with constant shapes, ``pad_to_max=True``) and print per
rank the median step time (alternating) and the peak RSS growth of one step (a fresh world per
mode).

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
from pathlib import Path

import torch

from megatron_tree.core.flops import GPTShape
from megatron_tree.core.packing import build_packed_tree_batch
from megatron_tree.testing.synthetic import long_history_sequences, multi_turn_batch, rl_batch

# The test harness (tests/harness: tiny models, spawned worlds, engine fixtures) is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

BATCH = dict(
    num_tasks=10,
    rollouts_per_task=4,
    turns=(3, 7),
    system_len=1500,
    task_len=200,
    observation_len=(40, 140),
    action_len=(50, 150),
)
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


def make_batch(seed: int, kind: str = "agent") -> dict:
    """The agent batch (or, ``kind="long"``, a 24,000-token history shared by 10 tasks) with the
    per-token inputs of a PPO step (loss mask rolled: entry t is about token t + 1, so it marks
    the entries that predict generated tokens)."""
    if kind == "long":
        return rl_batch(
            long_history_sequences(history_len=24000, num_tasks=10, vocab_size=VOCAB, seed=seed),
            response_start=24000,
        )
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


def pack(batch: dict, capacity: int, mode: str, pad_to_max: bool = False):
    packing = MODES[mode]
    return build_packed_tree_batch(
        batch, max_tokens_per_mb=capacity, block_size=BLOCK, pad_to_max=pad_to_max, **packing
    )


def config_for(args, **parallel):
    from harness.models import small_gpt_config

    return small_gpt_config(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=4 * args.hidden,
        **parallel,
    )


def build_model(args):
    from harness.dist import single_process_world
    from harness.models import build_gpt_model

    single_process_world()  # applies the CPU patch (megatron_tree.patches.megatron_cpu)
    return build_gpt_model(
        config_for(args), tree=True, vocab_size=VOCAB, backend="block_sparse", block_size=BLOCK
    )


def train_step(model, packed, mode: str = "tree") -> float:
    """One forward + backward of a packed batch (gradients zeroed first); seconds."""
    from megatron_tree.core.heads import LogProbs
    from megatron_tree.core.losses import ppo_clipped_loss
    from megatron_tree.mcore.step import tree_forward_backward

    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    tree_forward_backward(
        model,
        packed,
        lambda out, mb: ppo_clipped_loss(out, mb, clip_eps=0.2, entropy_coef=0.01),
        gather=LogProbs(),
    )
    return time.perf_counter() - t0


def child(args) -> None:
    """One step of ``args.child`` in this fresh process; prints {"mib": peak RSS growth} as JSON."""
    model = build_model(args)
    packed = pack(make_batch(args.seed, args.batch), args.capacity, args.child)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    train_step(model, packed, args.child)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"mib": (after - before) / 1024, "before_mib": before / 1024}))


def packing_table(batch, args, modes, shape):
    """Prints the packing table; returns ({mode: packed}, unique count, {mode: (cost, 8B cost)})."""
    unique = unique_prefix_count(batch)
    total = int(batch["attention_mask"].sum())
    print(
        f"batch: {batch['input_ids'].shape[0]} sequences, {total} tokens, {unique} unique "
        f"(single-trie count), longest {int(batch['attention_mask'].sum(1).max())}"
    )
    ideal = build_packed_tree_batch(
        batch,
        max_tokens_per_mb=-(-total // BLOCK) * BLOCK,
        block_size=BLOCK,
        pad_to_max=False,
        share_trunks=False,
    )
    packed, costs = {}, {}
    print(
        f"\n1. packing, capacity {args.capacity}; FLOP model (fwd+bwd) of the CPU model "
        f"({shape.hidden}h x {shape.layers}L) and of an 8B-class model"
    )
    print(
        f"{'mode':10} {'micro-b':>7} {'tokens':>8} {'padded':>8} {'/unique':>8} {'GFLOP':>9} "
        f"{'/ideal':>7} {'8B TFLOP':>9} {'/ideal':>7}"
    )
    for name in ["ideal"] + modes:
        if name == "ideal":
            p = ideal
        else:
            log(f"packing {name}")
            p = packed[name] = pack(batch, args.capacity, name)
        costs[name] = (sum(p.tree_costs(shape)), sum(p.tree_costs(LARGE)))
        ratio = [c / i for c, i in zip(costs[name], costs["ideal"])]
        print(
            f"{name:10} {len(p):7d} {p.num_tree_tokens:8d} {p.num_padded_tokens:8d} "
            f"{p.num_tree_tokens / unique:8.3f} {costs[name][0] / 1e9:9.1f} {ratio[0]:7.3f} "
            f"{costs[name][1] / 1e12:9.1f} {ratio[1]:7.3f}"
        )
    return packed, unique, costs


def print_layout(packed) -> None:
    print("\n2. trunk-reuse layout (rows real/padded, sequences whose loss the micro-batch takes)")
    for i, mb in enumerate(packed):
        rows = mb["rows"]
        if rows.group is None:
            tree = mb["tree"]
            print(
                f"  mb {i}: plain tree  rows {tree.num_tree_tokens}/{tree.padded_length}, "
                f"{tree.num_sequences} seqs"
            )
        else:
            kind = f"trunk {rows.index}" if rows.is_trunk else f"branch {rows.index}"
            print(
                f"  mb {i}: group {rows.group} {kind:9} rows {rows.num_real}/{rows.num_rows}, "
                f"{mb['tree'].num_sequences} seqs, depth < {rows.reach}"
            )


def time_steps(packed, args) -> dict:
    log("building the model")
    model = build_model(args)
    times = {"tree": [], "trunk": []}
    for mode in times:  # warm-up, one each
        log(f"warm-up step: {mode}")
        train_step(model, packed[mode], mode)
    for r in range(args.repeats):
        for mode in times:
            times[mode].append(train_step(model, packed[mode], mode))
        log(
            f"repeat {r + 1}/{args.repeats}: "
            + ", ".join(f"{m} {t[-1]:.2f} s" for m, t in times.items())
        )
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
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--threads",
        str(args.threads),
        "--capacity",
        str(args.capacity),
        "--hidden",
        str(args.hidden),
        "--layers",
        str(args.layers),
        "--seed",
        str(args.seed),
        "--batch",
        args.batch,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr)
        raise RuntimeError(f"the {mode} memory child failed (exit {proc.returncode})")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["before_mib"] <= parent:  # the child's baseline may be the parent's inherited peak
        log(
            f"warning: {mode} child's RSS before the step <= this process's peak ({parent:.0f} MiB)"
        )
    return result


def _layout_worker(rank: int, args, modes: list[str], repeats: int) -> dict:
    """One rank of a cp2 / pp2 world: per mode, step times (alternating) and the peak RSS growth of
    the first step (meaningful when ``modes`` holds one mode: a fresh world per mode)."""
    from megatron.core import parallel_state as ps

    from harness.models import build_gpt_model

    torch.set_num_threads(args.threads)
    pp, cp = ps.get_pipeline_model_parallel_world_size(), ps.get_context_parallel_world_size()
    config = config_for(args, pipeline_model_parallel_size=pp, context_parallel_size=cp)
    model = build_gpt_model(
        config, tree=True, vocab_size=VOCAB, backend="block_sparse", block_size=BLOCK
    )
    batch = make_batch(args.seed)
    packed = {m: pack(batch, args.capacity, m, pad_to_max=pp > 1) for m in modes}
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = {m: [train_step(model, packed[m], m)] for m in modes}
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    for _ in range(repeats):
        for m in modes:
            times[m].append(train_step(model, packed[m], m))
    return {
        "seconds": {m: statistics.median(t[1:]) if len(t) > 1 else t[0] for m, t in times.items()},
        "mib": grown,
        "micro_batches": {m: len(p) for m, p in packed.items()},
        "rows": {m: p.num_padded_tokens for m, p in packed.items()},
        "tokens": {m: p.num_tree_tokens for m, p in packed.items()},
        "trunk_parts": {m: sum(mb["rows"].records for mb in p) for m, p in packed.items()},
    }


def layout_main(args) -> None:
    """Tree packing vs trunk reuse on a 2-process CP or PP world."""
    from harness.dist import run_spawned

    layout = {"cp2": dict(cp=2, tp=1), "pp2": dict(pp=2, tp=1)}[args.layout]
    modes = ["tree", "trunk"]
    memory = {}
    for m in modes:
        log(f"{args.layout}: peak memory of one {m} step (a fresh 2-process world)")
        memory[m] = [r["mib"] for r in run_spawned(_layout_worker, 2, args, [m], 0, **layout)]
    log(f"{args.layout}: {args.repeats} alternating steps per mode after a first one")
    ranks = run_spawned(_layout_worker, 2, args, modes, args.repeats, **layout)
    print(
        f"layout {args.layout}: {args.layers} layers, hidden {args.hidden}, capacity "
        f"{args.capacity}{', pad_to_max' if args.layout == 'pp2' else ''}; torch threads "
        f"{args.threads} per rank"
    )
    print(
        f"{'mode':8} {'micro-b':>7} {'trunk p':>7} {'tokens':>8} {'rows':>8} "
        + " ".join(f"{f'rank{r} s':>9} {f'rank{r} MiB':>10}" for r in range(2))
    )
    for m in modes:
        cells = " ".join(f"{ranks[r]['seconds'][m]:9.2f} {memory[m][r]:10.1f}" for r in range(2))
        print(
            f"{m:8} {ranks[0]['micro_batches'][m]:7d} {ranks[0]['trunk_parts'][m]:7d} "
            f"{ranks[0]['tokens'][m]:8d} {ranks[0]['rows'][m]:8d} {cells}"
        )
    ratio = max(r["seconds"]["tree"] for r in ranks) / max(r["seconds"]["trunk"] for r in ranks)
    print(f"  trunk reuse x{ratio:.3f} faster than tree packing (slowest rank's median step)")


def long_main(args) -> None:
    """The long-history batch: tokens against the single trie, then trunk reuse's step time and
    peak memory (a chain of trunk parts, recomputed: one micro-batch's activations at a time)."""
    modes = ["trunk"]
    memory = {mode: peak_memory(mode, args) for mode in modes}
    batch = make_batch(args.seed, "long")
    unique = unique_prefix_count(batch)
    packed = pack(batch, args.capacity, "trunk")
    parts = [mb["rows"] for mb in packed]
    print(
        f"long history: {batch['input_ids'].shape[0]} sequences, "
        f"{int(batch['attention_mask'].sum())} tokens, {unique} unique, longest "
        f"{int(batch['attention_mask'].sum(1).max())}; capacity {args.capacity}"
    )
    print(
        f"  trunk reuse: {len(packed)} micro-batches ({sum(p.records for p in parts)} trunk "
        f"parts), tokens {packed.num_tree_tokens} (x{packed.num_tree_tokens / unique:.4f} of "
        f"unique), padded {packed.num_padded_tokens}"
    )
    log("building the model")
    model = build_model(args)
    times = {m: [] for m in modes}
    for r in range(args.repeats + 1):  # the first round warms up
        for m in modes:
            seconds = train_step(model, packed, m)
            if r:
                times[m].append(seconds)
            log(f"round {r}: {m} {seconds:.2f} s")
    for m in modes:
        print(
            f"  {m:9} step {statistics.median(times[m]):8.2f} s (median of {args.repeats}), peak "
            f"RSS growth {memory[m]['mib']:8.1f} MiB"
        )
    over = packed.num_tree_tokens / unique
    print(
        f"  [{'PASS' if over <= 1.02 else 'FAIL'}] tokens within 2% of the single trie "
        f"(x{over:.4f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed steps per mode (tree, trunk), alternating"
    )
    parser.add_argument(
        "--unshared-repeats", type=int, default=1, help="timed steps of the unshared baseline"
    )
    parser.add_argument(
        "--skip-unshared", action="store_true", help="no step time or memory of the baseline"
    )
    parser.add_argument("--capacity", type=int, default=8192, help="max_tokens_per_mb")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=4, help="seed of the synthetic batch")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: on this shared 2-core machine two threads made "
        "step times vary by up to 1.5x from run to run)",
    )
    parser.add_argument(
        "--layout",
        choices=["pp1", "cp2", "pp2"],
        default="pp1",
        help="pp1: one process (all tables); cp2 / pp2: a 2-process world, tree vs trunk",
    )
    parser.add_argument(
        "--batch",
        choices=["agent", "long"],
        default="agent",
        help="long: a 24,000-token history shared by 10 tasks (trunk reuse only: tree packing "
        "refuses sequences longer than a micro-batch)",
    )
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        return child(args)
    if args.layout != "pp1":
        return layout_main(args)
    if args.batch == "long":
        return long_main(args)

    modes = [m for m in MODES if not (args.skip_unshared and m == "unshared")]
    memory = {mode: peak_memory(mode, args) for mode in modes}  # while this process is small
    config = config_for(args)
    shape = GPTShape.from_config(config, VOCAB)
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, 4 heads / 2 query groups, FFN "
        f"{4 * args.hidden}, vocab {VOCAB}, block_sparse tiles of {BLOCK}; torch threads "
        f"{torch.get_num_threads()}"
    )
    log("building the batch")
    batch = make_batch(args.seed)
    packed, unique, costs = packing_table(batch, args, list(MODES), shape)
    print_layout(packed["trunk"])

    seconds, paired = time_steps(packed, args)
    print(
        f"\n3. training step (forward + backward), median of {args.repeats} alternating runs after "
        "a warm-up"
    )
    for mode, s in seconds.items():
        print(
            f"  {mode:9} {s:8.2f} s   x{s / seconds['trunk']:.2f} of trunk reuse"
            + (f"  (median of {args.unshared_repeats})" if mode == "unshared" else "")
        )

    print(
        "\n4. peak RSS growth of one training step (fresh process; ru_maxrss after - before the "
        "step)"
    )
    print(
        "   (trunk: the trunk parts run without grad first and are recomputed last, so only one "
        "micro-batch's activations are alive at a time; one more trunk forward)"
    )
    for mode, m in memory.items():
        print(f"  {mode:9} {m['mib']:8.1f} MiB   (RSS before the step {m['before_mib']:.0f} MiB)")

    over = packed["trunk"].num_tree_tokens / unique
    speedup = seconds["tree"] / seconds["trunk"]
    print("\n5. goals")
    print(
        f"  [{'PASS' if over <= 1.10 else 'FAIL'}] trunk-reuse tokens "
        f"{packed['trunk'].num_tree_tokens} within 10% of the single trie's {unique} (x{over:.3f})"
    )
    flops = [t / r for t, r in zip(costs["tree"], costs["trunk"])]
    print(
        f"  FLOP model, tree / trunk: x{flops[0]:.3f} on the CPU model, x{flops[1]:.3f} on the "
        "8B-class model (tokens "
        f"x{packed['tree'].num_tree_tokens / packed['trunk'].num_tree_tokens:.3f})"
    )
    print(
        f"  [{'PASS' if speedup >= 1.25 else 'FAIL'}] trunk-reuse step x{speedup:.3f} faster than "
        f"tree packing (goal >= 1.25; tree {seconds['tree']:.2f} s, trunk {seconds['trunk']:.2f} "
        f"s; median of the {args.repeats} paired ratios x{paired:.3f})"
    )


if __name__ == "__main__":
    main()
