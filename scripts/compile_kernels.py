"""Compile our Triton tree-attention kernels ahead of time for sm_80 (A100) and sm_90 (H100/H200) on
a CPU, at every configuration the package launches, and read their resources off the cubins.

    python scripts/compile_kernels.py                      # CI's set; exit 1 on any failure
    python scripts/compile_kernels.py --all                # every configuration (docs/gpu.md)
    python scripts/compile_kernels.py --markdown table.md  # also written as markdown
    python scripts/compile_kernels.py --only 'fwd hd256' --launch 128,8,3   # try another config

No GPU or CUDA driver is needed: Triton compiles for a named target, its wheel ships ``ptxas`` and
``cuobjdump``. What is compiled is what a launch would compile: the package's own launcher
(``triton_attention._forward`` / ``_backward``) runs on CPU tensors of the configuration's shapes
and dtypes with each kernel swapped for a recorder, and Triton's own binder turns the recorded
arguments into the signature, constants and specialization (16-byte alignment, divisibility by 16)
a launch would get; the tile, warps and stages come from ``triton_tiles.launch_config``. Lengths
are multiples of the tile (the packer pads micro-batches to its block size), so integer arguments
carry Triton's divisible-by-16 specialization; other lengths compile a variant without it.

Per kernel and configuration: compiled or the compiler's error, registers, spilled bytes (the
cubin's stack frame, where ptxas spills), shared memory of the launch against the architecture's
per-block maximum, and the tensor-core instructions in the PTX (``mma.sync`` on sm_80; ``wgmma``
on sm_90 where the tile allows, 64 rows a warpgroup, else ``mma.sync``). A row fails on a compile
error, shared memory over the limit, spills over ``SPILL_BOUND``, or no tensor-core instruction.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter's

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile, make_backend
from triton.runtime.jit import create_function_from_signature

from megatron_tree.core import triton_attention as ta
from megatron_tree.core.triton_tiles import (
    ARCHES,
    SHARED_LIMIT,
    LaunchConfig,
    launch_config,
)
from megatron_tree.patches._scoped import swapped

# Spilled bytes per thread a row may have. A spill moves registers to local memory, cached in L1:
# a few dozen values cost a few accesses per tile step; past a few hundred bytes the inner loop
# waits on local memory. The bound is 64 fp32 values. launch_config's picks: forward and dQ never
# spill; dK/dV spills at most 136 B (sm_80, head dim 256, under a window), 88 B (sm_90, 128), 48 B
# (sm_90, 256); the rejected candidates spilled 152-2,936 B (docs/gpu.md).
SPILL_BOUND = 256
# (query-key, value) head dims: Llama/Qwen widths, Gemma's 256, and MLA (DeepSeek-V3: 192 / 128).
HEAD_DIMS = {"hd64": (64, 64), "hd128": (128, 128), "hd256": (256, 256), "mla": (192, 128)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KERNELS = {"forward_kernel": "fwd", "dq_kernel": "dq", "dkdv_kernel": "dkdv"}
TENSOR_CORE = ("wgmma", "mma.sync")  # Hopper's warpgroup MMA; Ampere's (also run by Hopper)
# A launch's shapes: 16 query heads; GQA in 4 key-value groups, MHA one group a head (MLA's keys
# and values have a head per query head); 256 keys, queries all of them or every other one (a
# context-parallel rank's rows, a trunk-reuse part's).
HEADS, GROUPS, KEYS = 16, 4, 256


@dataclass(frozen=True)
class Config:
    dims: str
    dtype: str
    heads: str  # "gqa" or "mha"
    window: bool
    sink: bool
    rows: str  # "all" (the queries are the keys) or "subset"

    def label(self, kernel: str) -> str:
        parts = [KERNELS[kernel], self.dims, self.dtype, self.heads, self.rows]
        parts += ["window"] if self.window else []
        parts += ["sink"] if self.sink and kernel != "dkdv_kernel" else []  # dK/dV: no sink input
        return " ".join(parts)


def configs(every: bool) -> list[Config]:
    """Every configuration (``every``), or CI's set: per head dims and dtype the plain launch (GQA,
    queries all keys, no window or sink) and the heaviest (a query subset, window and sink, GQA and
    MHA), which bound the others' registers and shared memory (the full table: docs/gpu.md)."""
    out = []
    for dims, dtype, heads, window, sink, rows in itertools.product(
        HEAD_DIMS, DTYPES, ("gqa", "mha"), (False, True), (False, True), ("all", "subset")
    ):
        if dims == "mla" and heads == "gqa":
            continue  # Megatron's MLA has a key-value head per query head
        plain = (
            not window
            and not sink
            and rows == "all"
            and heads == ("mha" if dims == "mla" else "gqa")
        )
        if every or plain or (window and sink and rows == "subset"):
            out.append(Config(dims, dtype, heads, window, sink, rows))
    return out


# The launches to compile, (JIT kernel, args, kwargs), filled before the worker processes fork.
RECORDED: list[tuple] = []


class _Recorder:
    """Stands in for a JIT kernel: ``kernel[grid](*args, **kwargs)`` records, launches nothing."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.kernel, args, kwargs))


def record(config: Config, launch: LaunchConfig) -> list:
    """The three kernels' (kernel, args, kwargs) as the package's launcher passes them."""
    head_dim, value_dim = HEAD_DIMS[config.dims]
    dtype = DTYPES[config.dtype]
    groups = HEADS if config.heads == "mha" else GROUPS
    queries = torch.arange(0, KEYS, 2) if config.rows == "subset" else None
    nq = KEYS if queries is None else len(queries)
    q = torch.randn(nq, 1, HEADS, head_dim, dtype=dtype)
    k = torch.randn(KEYS, 1, groups, head_dim, dtype=dtype)
    v = torch.randn(KEYS, 1, groups, value_dim, dtype=dtype)
    sink = torch.zeros(HEADS) if config.sink else None
    window = 7 if config.window else None
    ends = torch.full((1, KEYS), KEYS)  # one chain; the facts' values do not change the compile
    facts = ta.tile_facts(ends, queries, launch.tile, window)
    layout = ta._Layout(
        facts, block=launch.tile, window=window, scale=0.1, dtype=dtype, launch=launch
    )
    calls: list = []
    recorders = {name: _Recorder(getattr(ta, name), calls) for name in KERNELS}
    with swapped(ta, **recorders):
        out, lse = ta._forward(q, k, v, sink, layout)
        ta._backward(q, k, v, out, lse, torch.randn_like(out), layout, sink_grad=config.sink)
    return calls


def _res_usage(cubin: bytes) -> dict[str, int]:
    """cuobjdump -res-usage's REG / STACK / SHARED / LOCAL of the cubin's kernel."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line:\n{text}")
    return dict(zip(("regs", "stack", "static_shared", "local"), map(int, found.groups())))


def compile_one(job: tuple) -> dict:
    """Compile one recorded launch for one architecture; the row of the table."""
    label, launch, arch, index = job
    kernel, args, kwargs = RECORDED[index]
    row = {"label": label, "arch": arch, "launch": launch}
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs, debug=False)
    t = time.perf_counter()
    try:
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constants, attrs = kernel._pack_args(
            backend, kwargs, bound, specialization, options
        )
        compiled = compile(
            ASTSource(kernel, signature, constants, attrs), target=target, options=options.__dict__
        )
    except Exception as error:  # the compiler's error is the row's result
        row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"
        row["seconds"] = time.perf_counter() - t
        return row
    row["seconds"] = time.perf_counter() - t
    row.update(_res_usage(compiled.asm["cubin"]))
    row["shared"] = compiled.metadata.shared
    ptx = compiled.asm["ptx"]
    row["tensor_core"] = [name for name in TENSOR_CORE if name in ptx]
    return row


def findings(row: dict) -> list[str]:
    """What a row breaks of the bounds (the module docstring)."""
    arch = row["arch"]
    if "error" in row:
        return [f"compile error: {row['error']}"]
    out = []
    if row["shared"] > SHARED_LIMIT[arch]:
        out.append(f"shared memory {row['shared']} B over sm_{arch}'s {SHARED_LIMIT[arch]} B")
    if max(row["stack"], row["local"]) > SPILL_BOUND:
        out.append(f"spills {max(row['stack'], row['local'])} B over the bound {SPILL_BOUND} B")
    if not row["tensor_core"] and not row["label"].startswith(THIRD):
        out.append("no tensor-core instruction (wgmma, mma.sync) in the PTX")
    return out


def failures(row: dict) -> list[str]:
    """The findings that fail the check: all of them for our kernels; for mamba_ssm's and fla's
    configs only a compile error (their autotuners prune a config over the shared memory and run
    one that spills; --all checks that each kernel keeps a config within shared memory)."""
    out = findings(row)
    if row["label"].startswith(THIRD) and "error" not in row:
        return []
    return out


def jobs(arches, every: bool, only: str | None, launch: LaunchConfig | None) -> list[tuple]:
    out, seen = [], set()
    for config in configs(every):
        for arch in arches:
            head_dim, value_dim = HEAD_DIMS[config.dims]
            picked = launch or launch_config(arch, head_dim, value_dim)
            for kernel, args, kwargs in record(config, picked):
                label = config.label(kernel.fn.__name__)
                if (label, arch) in seen or (only and not re.search(only, f"{label} sm_{arch}")):
                    continue
                seen.add((label, arch))
                RECORDED.append((kernel, args, kwargs))
                launch_text = f"{picked.tile} / {picked.num_warps} / {picked.num_stages}"
                out.append((label, launch_text, arch, len(RECORDED) - 1))
    return out


# The recurrent layers' third-party kernels at the shapes our tree wrappers call them: Mamba-2 as in
# Nemotron-H (head dim 64, 8 groups of state 128) through tree_ssd_mamba_ssm, and the gated delta
# rule as in Qwen3-Next (key and value head dims 128) through tree_gated_delta_rule_fla, bf16, on a
# branching tree whose levels run at several chunk lengths (16 to 64); forward and backward.
RECURRENT_HEADS = 16
THIRD = ("mamba_ssm ", "fla ")  # their rows' labels; tensor cores are theirs to use or not


def record_recurrent(every: bool) -> list[tuple[str, dict, tuple]]:
    """(package, launch kwargs, (kernel, args, kwargs)) of every launch mamba_ssm's and fla's
    wrappers make, each autotune config separately (``every``; the autotuner's pick needs a GPU's
    timings) or the first of each list (CI's set)."""
    import contextlib
    import importlib.util
    import types

    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    from megatron_tree.core.packing import build_packed_tree_batch
    from megatron_tree.core.recurrent import RecurrentPlan
    from megatron_tree.mcore.gdn_kernels import tree_gated_delta_rule_fla
    from megatron_tree.mcore.ssd_kernels import tree_ssd_mamba_ssm
    from megatron_tree.testing.synthetic import multi_turn_batch

    calls: list = []

    def jit_run(kernel, *args, grid, warmup, **kwargs):
        calls.append((package[0], kernel, args, kwargs))

    def autotuned_run(tuner, *args, **kwargs):
        tuner.best_config = tuner.configs[0]  # read after the launch by mamba's backward
        for config in tuner.configs if every else tuner.configs[:1]:
            tuner.fn.run(*args, **{**kwargs, **config.all_kwargs()})

    package = ["mamba_ssm"]
    batch = multi_turn_batch(num_tasks=2, rollouts_per_task=2, turns=2, system_len=40, task_len=20)
    packed = build_packed_tree_batch(
        batch, max_tokens_per_mb=1024, block_size=16, share_trunks=False
    )
    tree = packed[0]["tree"]
    plan, n, heads = RecurrentPlan(tree.subtree_end), tree.padded_length, RECURRENT_HEADS
    bf16 = torch.bfloat16
    shims = {"device": lambda *a, **k: contextlib.nullcontext()}  # a CPU tensor has no CUDA device
    shims["get_device_properties"] = lambda *a, **k: types.SimpleNamespace(
        multi_processor_count=132
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(swapped(JITFunction, run=jit_run))
        stack.enter_context(swapped(Autotuner, run=autotuned_run))
        stack.enter_context(swapped(torch.cuda, **shims))
        if importlib.util.find_spec("selective_scan_cuda") is None:  # unused by the SSD kernels
            sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
        x = torch.randn(n, heads, 64, dtype=bf16, requires_grad=True)
        dt = torch.rand(n, heads, requires_grad=True)
        a = -torch.rand(heads, requires_grad=True)
        b = torch.randn(n, 8, 128, dtype=bf16, requires_grad=True)
        c = torch.randn(n, 8, 128, dtype=bf16, requires_grad=True)
        tree_ssd_mamba_ssm(x, dt, a, b, c, plan).float().sum().backward()
        package[0] = "fla"
        q = torch.randn(n, heads, 128, dtype=bf16, requires_grad=True)
        k = torch.nn.functional.normalize(torch.randn(n, heads, 128), dim=-1).to(bf16)
        v = torch.randn(n, heads, 128, dtype=bf16, requires_grad=True)
        g = (-torch.rand(n, heads)).requires_grad_()
        beta = torch.rand(n, heads, dtype=bf16, requires_grad=True)
        out = tree_gated_delta_rule_fla(q, k.requires_grad_(), v, g, beta, plan)
        out.float().sum().backward()
    return [(pkg, kwargs, (kernel, args, kwargs)) for pkg, kernel, args, kwargs in calls]


def recurrent_jobs(arches, every: bool, only: str | None) -> list[tuple]:
    out, seen = [], set()
    for pkg, kwargs, call in record_recurrent(every):
        name = call[0].fn.__name__
        consts = {k: v for k, v in kwargs.items() if k.isupper() and isinstance(v, (int, bool))}
        warps, stages = kwargs.get("num_warps", 4), kwargs.get("num_stages", 3)
        label = f"{pkg} {name} " + " ".join(f"{k}={int(v)}" for k, v in consts.items())
        # One row per kernel and constants: launches that differ in runtime sizes only (each level's
        # bucket) compile to the same code but for Triton's divisibility hints.
        if (label, warps, stages) in seen:
            continue
        seen.add((label, warps, stages))
        for arch in arches:
            if only and not re.search(only, f"{label} sm_{arch}"):
                continue
            RECORDED.append(call)
            out.append((label, f"{warps} warps / {stages} stages", arch, len(RECORDED) - 1))
    return out


def markdown(rows: list[dict]) -> str:
    lines = [
        "| kernel and configuration | arch | tile / warps / stages | result | registers | "
        "spilled B | shared KB / limit | tensor cores | compile s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cfg = row["launch"]
        bad = findings(row)
        if "error" in row:
            cells = ["FAIL: " + row["error"], "-", "-", "-", "-"]
        else:
            cells = [
                ("FAIL: " if failures(row) else "note: ") + "; ".join(bad) if bad else "ok",
                str(row["regs"]),
                str(max(row["stack"], row["local"])),
                f"{row['shared'] / 1024:.0f} / {SHARED_LIMIT[row['arch']] // 1024}",
                ", ".join(row["tensor_core"]) or "none",
            ]
        lines.append(
            f"| {row['label']} | sm_{row['arch']} | {cfg} | "
            + " | ".join(cells)
            + f" | {row['seconds']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    """Per architecture, head dims and kernel: configurations compiled, the launch, the largest
    registers / spills / shared memory over them, how many spill, and the tensor-core
    instructions."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        first, second = row["label"].split()[
            :2
        ]  # ours: "fwd hd128 ..."; theirs: "fla <kernel> ..."
        kernel, dims = (second, first) if row["label"].startswith(THIRD) else (first, second)
        groups.setdefault((row["arch"], dims, kernel), []).append(row)
    lines = [
        "| arch | head dims or package | kernel | launch | compiled | registers (max) | "
        "spilled B (max; rows spilling) | shared KB (max) / limit | tensor cores |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (arch, dims, kernel), group in sorted(groups.items(), key=lambda kv: str(kv[0])):
        ok = [r for r in group if "error" not in r]
        spills = [max(r["stack"], r["local"]) for r in ok]
        launch = "autotuned" if group[0]["label"].startswith(THIRD) else group[0]["launch"]
        lines.append(
            f"| sm_{arch} | {dims} | {kernel} | {launch} | {len(ok)} / {len(group)} | "
            f"{max((r['regs'] for r in ok), default=0)} | "
            f"{max(spills, default=0)}; {sum(x > 0 for x in spills)} | "
            f"{max((r['shared'] for r in ok), default=0) / 1024:.0f} / "
            f"{SHARED_LIMIT[arch] // 1024} | "
            f"{', '.join(sorted({t for r in ok for t in r['tensor_core']})) or 'none'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHES), choices=ARCHES)
    parser.add_argument(
        "--all", action="store_true", help="every configuration, not CI's bounding set"
    )
    parser.add_argument("--only", help="a regex on the row labels, e.g. 'fwd hd128 bf16'")
    parser.add_argument(
        "--launch",
        help="TILE,WARPS,STAGES for every row instead of launch_config's (to try a config)",
    )
    parser.add_argument(
        "--recurrent",
        action="store_true",
        help="mamba_ssm's SSD and fla's gated delta-rule kernels (the kernels stack) instead",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the shapes are small; no OpenMP pool in the forked workers
    override = None
    if args.launch:
        try:
            override = LaunchConfig(*(int(x) for x in args.launch.split(",")))
        except TypeError:
            parser.error(f"--launch {args.launch}: give TILE,WARPS,STAGES, e.g. 64,8,2")
    if args.recurrent:
        todo = recurrent_jobs(args.arch, args.all, args.only)
    else:
        todo = jobs(args.arch, args.all, args.only, override)
    if not todo:
        parser.error(f"--only {args.only!r} matches no kernel configuration")
    print(
        f"[compile] {len(todo)} kernel configurations for "
        f"{', '.join(f'sm_{a}' for a in args.arch)} (triton {triton.__version__}), "
        f"{args.jobs} processes",
        flush=True,
    )
    t = time.perf_counter()
    rows = []
    # fork: the workers inherit RECORDED (and, for --recurrent, the recorders' module state)
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for i, row in enumerate(pool.map(compile_one, todo, chunksize=4), 1):
            rows.append(row)
            if i % 40 == 0 or i == len(todo):
                print(f"[compile] {i}/{len(todo)} ({time.perf_counter() - t:.0f} s)", flush=True)
    table = markdown(rows) + "\n" + summary(rows)
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    bad = [(row, failures(row)) for row in rows if failures(row)]
    for row, why in bad:
        print(f"[compile] FAIL {row['label']} sm_{row['arch']}: {'; '.join(why)}", file=sys.stderr)
    print(
        f"[compile] {len(rows) - len(bad)} of {len(rows)} ok in {time.perf_counter() - t:.0f} s",
        flush=True,
    )
    if args.recurrent and args.all:
        # A kernel fails when none of its configs fits the shared memory (nothing left to run).
        kernels = {(row["label"].split()[1], row["arch"]) for row in rows}
        fitting = {
            (row["label"].split()[1], row["arch"])
            for row in rows
            if "error" not in row and row["shared"] <= SHARED_LIMIT[row["arch"]]
        }
        for name, arch in sorted(kernels - fitting):
            print(
                f"[compile] FAIL {name} sm_{arch}: no config within shared memory", file=sys.stderr
            )
        print(f"[compile] {len(fitting)} of {len(kernels)} kernel x arch keep a config that fits")
        bad += [({}, ["no config fits"])] * len(kernels - fitting)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
