"""Packing-only benchmark of trunk reuse: tokens computed and padded rows against the single trie.

    .venv/bin/python scripts/bench_trunk_packing.py [--batches 600] [--seed 0]
                                                    [--old-package PATH]

No model runs; only ``build_packed_tree_batch`` (``pad_to_max=False`` throughout), with
``share_trunks=False`` (tries cut at branch points, shared prefixes repeated per micro-batch) and
``share_trunks=True`` (trunk reuse: a trunk runs once and its branches attend to its keys and
values). Every count is read off ``len(packed)``, ``packed.num_tree_tokens`` (tokens computed, a
trunk counted once) and ``packed.num_padded_tokens`` (padded rows), and compared with the single
trie's unique-token count, counted here independently of the packer (sort the sequences; each adds
its length minus its longest common prefix with its predecessor). It prints:

1. the GRPO case: one 110-token prompt with 8 distinct 12-token responses, capacity 124,
   block_size 1 (so no alignment padding);
2. a fuzz of ``--batches`` seeded random batches (batch i uses seed ``--seed`` + i, so a run is
   reproducible and a batch can be replayed alone): GRPO-like groups, multi-turn agent groups
   (``multi_turn_batch``) and unrelated sequences, block_size 16, capacities multiples of 16 drawn
   so that most batches hold a trie larger than the capacity, every sequence within the capacity
   (so that ``share_trunks=False`` packs it too); a summary of tokens computed / unique and padded
   rows / unique, and the batches where trunk reuse computed more padded rows than cutting;
3. a long-context case: a 24,000-token history shared by 10 tasks (some with a second turn),
   capacity 8192, block_size 128, which only trunk reuse can pack (its sequences are longer than a
   micro-batch: they run as chains of trunk parts).

``--old-package PATH`` puts PATH first on ``sys.path`` before importing ``megatron_tree``, so the
same script measures an older checkout's packer (e.g. ``git worktree add /tmp/old_mt HEAD``); such
a packer may lack ``mb["rows"]`` (the layout columns then read n/a) and may refuse sequences longer
than a micro-batch with a ValueError, which is caught and reported. Tables go to stdout, progress
to stderr; PASS/FAIL lines state the goals. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

VOCAB = 50000
FUZZ_BLOCK = 16


def log(msg: str) -> None:
    print(f"[bench_trunk_packing {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=600, help="random batches of the fuzz")
    parser.add_argument("--seed", type=int, default=0, help="batch i of the fuzz uses seed + i")
    parser.add_argument(
        "--old-package",
        metavar="PATH",
        help="a checkout whose megatron_tree is measured instead of this one's",
    )
    return parser.parse_args()


# -- independent counts ------------------------------------------------------------------------


def lcp_len(a: tuple, b: tuple) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def trie_counts(seqs: list) -> tuple[int, list[int]]:
    """(the single trie's unique tokens, unique tokens of each root trie): sort the sequences; each
    adds its length minus its LCP with its predecessor, and an LCP of 0 starts a new root trie."""
    total, roots, prev = 0, [], ()
    for seq in sorted(tuple(s.tolist()) for s in seqs):
        common = lcp_len(prev, seq)
        if common == 0:
            roots.append(0)
        total += len(seq) - common
        roots[-1] += len(seq) - common
        prev = seq
    return total, roots


def layout(packed) -> tuple[str, str]:
    """(trunk parts, branch micro-batches) read off ``mb["rows"]``; n/a for a packer without it."""
    if not all("rows" in mb for mb in packed):
        return "n/a", "n/a"
    rows = [mb["rows"] for mb in packed]
    trunk = sum(r.group is not None and r.records for r in rows)
    branch = sum(r.group is not None and not r.records for r in rows)
    return str(trunk), str(branch)


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)]


# -- batches -----------------------------------------------------------------------------------


def tokens(g, n: int):
    import torch

    return torch.randint(1, VOCAB, (n,), generator=g)


def grpo_case_seqs():
    import torch

    g = torch.Generator().manual_seed(1)
    prompt = tokens(g, 110)
    responses = []
    while len(responses) < 8:  # distinct first tokens: 8 distinct responses, 8 leaves
        r = tokens(g, 12)
        if all(int(r[0]) != int(o[0]) for o in responses):
            responses.append(r)
    return [torch.cat([prompt, r]) for r in responses]


def fuzz_seqs(seed: int, multi_turn_batch) -> list:
    """One random batch's sequences: GRPO-like groups, agent groups, unrelated sequences."""
    import torch

    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    seqs = []
    for _ in range(rng.randint(1, 4)):
        prompt = tokens(g, rng.randint(20, 600))
        for _ in range(rng.randint(2, 16)):
            seqs.append(torch.cat([prompt, tokens(g, rng.randint(5, 300))]))
    for _ in range(rng.choice([0, 0, 1, 1, 2])):
        batch = multi_turn_batch(
            num_tasks=rng.randint(1, 3),
            rollouts_per_task=rng.randint(1, 3),
            turns=(1, 3),
            system_len=rng.randint(20, 400),
            task_len=rng.randint(10, 150),
            observation_len=(10, 80),
            action_len=(10, 120),
            vocab_size=VOCAB,
            seed=rng.randrange(2**31),
        )
        lengths = batch["attention_mask"].sum(1).tolist()
        seqs += [row[:n].clone() for row, n in zip(batch["input_ids"], lengths)]
    for _ in range(rng.randint(0, 6)):
        seqs.append(tokens(g, rng.randint(5, 600)))
    return seqs


def fuzz_capacity(seed: int, longest: int, largest_trie: int) -> int:
    """A multiple of FUZZ_BLOCK holding the longest sequence; below the largest trie in ~85% of
    the batches where that is possible."""
    rng = random.Random(seed ^ 0x5EED)
    low = -(-longest // FUZZ_BLOCK)
    top = (largest_trie - 1) // FUZZ_BLOCK
    if top >= low and rng.random() < 0.85:
        return FUZZ_BLOCK * rng.randint(low, top)
    return FUZZ_BLOCK * rng.randint(low, max(low, 2 * largest_trie // FUZZ_BLOCK))


def long_context_seqs():
    from megatron_tree.testing.synthetic import long_history_sequences

    seqs = long_history_sequences(history_len=24000, num_tasks=10, vocab_size=VOCAB, seed=7)
    return seqs, len(range(0, 10, 3))


# -- sections ----------------------------------------------------------------------------------


def pack(build, pad, seqs, capacity: int, block: int, share_trunks: bool):
    return build(
        pad(seqs),
        max_tokens_per_mb=capacity,
        block_size=block,
        pad_to_max=False,
        share_trunks=share_trunks,
    )


def grpo_case(build, pad) -> bool:
    seqs = grpo_case_seqs()
    unique, _ = trie_counts(seqs)
    total = sum(len(s) for s in seqs)
    print(
        f"1. GRPO case: one 110-token prompt, 8 distinct 12-token responses ({total} tokens, "
        f"{unique} unique);\n   capacity 124, block_size 1 (no alignment padding), pad_to_max False"
    )
    print(
        f"  {'share_trunks':12} {'micro-b':>7} {'tokens':>7} {'padded':>7} {'unique':>7} "
        f"{'tok/uniq':>8} {'pad/uniq':>8} {'trunk':>5} {'branch':>6}"
    )
    result = {}
    for share in (False, True):
        p = pack(build, pad, seqs, 124, 1, share)
        result[share] = p.num_tree_tokens
        trunk, branch = layout(p)
        print(
            f"  {share!s:12} {len(p):7d} {p.num_tree_tokens:7d} {p.num_padded_tokens:7d} "
            f"{unique:7d} {p.num_tree_tokens / unique:8.3f} {p.num_padded_tokens / unique:8.3f} "
            f"{trunk:>5} {branch:>6}"
        )
    ok = result[True] == unique
    print(
        f"  [{'PASS' if ok else 'FAIL'}] trunk reuse computes the single trie's {unique} tokens "
        f"(computed {result[True]}; share_trunks=False {result[False]})"
    )
    return ok


def fuzz(build, pad, multi_turn_batch, args) -> bool:
    stats = {False: [], True: []}  # per batch: (tokens / unique, padded / unique)
    over, worse, errors = [], [], {False: [], True: []}
    t0 = time.perf_counter()
    for i in range(args.batches):
        seed = args.seed + i
        seqs = fuzz_seqs(seed, multi_turn_batch)
        unique, roots = trie_counts(seqs)
        capacity = fuzz_capacity(seed, max(len(s) for s in seqs), max(roots))
        over.append(max(roots) > capacity)
        packed = {}
        for share in (False, True):
            try:
                packed[share] = p = pack(build, pad, seqs, capacity, FUZZ_BLOCK, share)
            except ValueError as e:
                errors[share].append((seed, str(e).splitlines()[0]))
                continue
            stats[share].append(
                (p.num_tree_tokens / unique, p.num_padded_tokens / unique, seed, over[-1])
            )
        if len(packed) == 2 and packed[True].num_padded_tokens > packed[False].num_padded_tokens:
            worse.append(
                (
                    seed,
                    len(seqs),
                    sum(len(s) for s in seqs),
                    unique,
                    max(roots),
                    capacity,
                    packed[False],
                    packed[True],
                )
            )
        if (i + 1) % 100 == 0:
            log(f"fuzz: {i + 1}/{args.batches} batches, {time.perf_counter() - t0:.1f} s")
    seconds = time.perf_counter() - t0

    last = args.seed + args.batches - 1
    print(
        f"\n2. fuzz: {args.batches} random batches (seeds {args.seed}..{last}), block_size "
        f"{FUZZ_BLOCK}, pad_to_max False;\n   ratios over the single trie's unique tokens"
    )
    print(f"  batches holding a trie larger than the capacity: {sum(over)} of {args.batches}")
    print(f"  {'':36} {'share_trunks=False':>20} {'share_trunks=True':>20}")

    def row(label, fn):
        cells = [fn(stats[share]) if stats[share] else "-" for share in (False, True)]
        print(f"  {label:36} {cells[0]:>20} {cells[1]:>20}")

    row("batches packed", lambda s: str(len(s)))
    row("  of them with an over-capacity trie", lambda s: str(sum(x[3] for x in s)))
    print(f"  {'refused (ValueError)':36} {len(errors[False]):>20} {len(errors[True]):>20}")
    for k, name in ((0, "tokens computed"), (1, "padded rows")):
        row(f"{name} / unique > 1.5", lambda s, k=k: str(sum(x[k] > 1.5 for x in s)))
        row(f"{name} / unique median", lambda s, k=k: f"{quantile([x[k] for x in s], 0.5):.3f}")
        row(f"{name} / unique p90", lambda s, k=k: f"{quantile([x[k] for x in s], 0.9):.3f}")
        row(
            f"{name} / unique worst (seed)",
            lambda s, k=k: "{:.3f} ({:d})".format(*max((x[k], x[2]) for x in s)),
        )
        row(
            "  over-capacity batches: median",
            lambda s, k=k: f"{quantile([x[k] for x in s if x[3]] or [0.0], 0.5):.3f}",
        )
        row(
            "  over-capacity batches: p90",
            lambda s, k=k: f"{quantile([x[k] for x in s if x[3]] or [0.0], 0.9):.3f}",
        )
    for share in (False, True):
        if errors[share]:
            seed, msg = errors[share][0]
            print(
                f"  share_trunks={share}: {len(errors[share])} batches refused with ValueError; "
                f"first seed {seed}: {msg}"
            )
    print(f"  packing time: {seconds:.1f} s for {2 * args.batches} packings")
    ok = not worse
    print(
        f"  [{'PASS' if ok else 'FAIL'}] batches where trunk reuse computed more padded rows than "
        f"share_trunks=False: {len(worse)}"
    )
    if worse:
        seed, n, total, unique, largest, cap, off, on = worse[0]
        print(
            f"    first: seed {seed}: {n} sequences, {total} tokens, {unique} unique, largest trie "
            f"{largest}, capacity {cap};\n    padded rows {off.num_padded_tokens} (False, "
            f"{len(off)} micro-b) vs {on.num_padded_tokens} (True, {len(on)} micro-b); tokens "
            f"{off.num_tree_tokens} vs {on.num_tree_tokens}"
        )
    return ok


def long_context(build, pad) -> bool:
    seqs, second = long_context_seqs()
    unique, _ = trie_counts(seqs)
    total = sum(len(s) for s in seqs)
    print(
        f"\n3. long context: a 24000-token history, 10 tasks of 200-600 tokens ({second} with a "
        f"second turn):\n   {len(seqs)} sequences, {total} tokens, {unique} unique, longest "
        f"{max(len(s) for s in seqs)}; capacity 8192, block_size 128, pad_to_max False"
    )
    ok = True
    try:
        p = pack(build, pad, seqs, 8192, 128, True)
    except ValueError as e:
        print(f"  share_trunks=True: raises ValueError: {str(e).splitlines()[0]}")
        print(f"  [FAIL] trunk-reuse tokens within 2% of the single trie's {unique} (not packed)")
        ok = False
    else:
        trunk, branch = layout(p)
        ratio = p.num_tree_tokens / unique
        print(
            f"  share_trunks=True: {len(p)} micro-batches ({trunk} trunk parts, {branch} branch "
            f"micro-batches),\n    tokens computed {p.num_tree_tokens}, padded rows "
            f"{p.num_padded_tokens} (x{p.num_padded_tokens / unique:.3f} of unique)"
        )
        ok = ratio <= 1.02
        print(
            f"  [{'PASS' if ok else 'FAIL'}] trunk-reuse tokens {p.num_tree_tokens} within 2% of "
            f"the single trie's {unique} (x{ratio:.4f})"
        )
    try:
        p = pack(build, pad, seqs, 8192, 128, False)
    except ValueError as e:
        print(f"  [PASS] share_trunks=False raises ValueError: {str(e).splitlines()[0]}")
    else:
        print(
            f"  [FAIL] share_trunks=False packed it ({len(p)} micro-batches, tokens "
            f"{p.num_tree_tokens}) instead of raising ValueError"
        )
        ok = False
    return ok


def main() -> None:
    args = parse_args()
    if args.old_package:
        sys.path.insert(0, os.path.abspath(args.old_package))
    import torch

    import megatron_tree
    from megatron_tree.core.packing import build_packed_tree_batch
    from megatron_tree.testing.synthetic import multi_turn_batch, pad_sequences

    where = os.path.dirname(os.path.dirname(os.path.abspath(megatron_tree.__file__)))
    if args.old_package and where != os.path.abspath(args.old_package):
        sys.exit(f"megatron_tree was imported from {where}, not from --old-package")
    torch.set_num_threads(1)
    print(f"packer: megatron_tree from {where}")
    t0 = time.perf_counter()
    log("GRPO case")
    goals = [grpo_case(build_packed_tree_batch, pad_sequences)]
    log(f"fuzz of {args.batches} batches")
    goals.append(fuzz(build_packed_tree_batch, pad_sequences, multi_turn_batch, args))
    log("long-context case")
    goals.append(long_context(build_packed_tree_batch, pad_sequences))
    print(f"\ngoals met: {sum(goals)} of {len(goals)}; {time.perf_counter() - t0:.1f} s in all")


if __name__ == "__main__":
    main()
