"""The finiteness check's cost (core/finite.py) inside the main job and the trunk benchmark.

    .venv/bin/python scripts/bench_finite.py [--job main|trunk|both]

Runs ``examples/tree_vs_baseline.py --small`` and ``scripts/bench_trunk.py --repeats 3``
in this process with two clocks installed: one around every call of the check
(``FiniteCheck.add``, ``add_loss``, ``raise_if_any``: the flags and their one host read) and one
around every ``tree_forward_backward`` step that contains them. It prints, per job, the steps'
total and median seconds, the check's seconds inside them and the ratio (the check's share of a
step). A share is measured in the same run as the steps it is a part of, so machine noise moves
both; an A/B of whole steps with and without the check could not resolve 1% on these machines.
The jobs' own output goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import runpy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = {
    "main": (ROOT / "examples" / "tree_vs_baseline.py", ["--model", "qwen3_tiny", "--small"]),
    "trunk": (ROOT / "scripts" / "bench_trunk.py", ["--repeats", "3", "--skip-unshared"]),
}


class Clock:
    """Seconds spent in the wrapped functions; ``steps`` holds one entry per outermost step."""

    def __init__(self):
        self.check = 0.0
        self.steps: list[tuple[float, float]] = []  # (step seconds, check seconds inside it)
        self._depth = 0

    def wrap_check(self, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.check += time.perf_counter() - t

        return timed

    def wrap_step(self, fn):
        def timed(*args, **kwargs):
            self._depth += 1
            t, check = time.perf_counter(), self.check
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.steps.append((time.perf_counter() - t, self.check - check))

        return timed


def run(name: str) -> Clock:
    import megatron_tree
    import megatron_tree.mcore.step as step_module
    from megatron_tree.core import finite

    clock = Clock()
    saved_check = {k: getattr(finite.FiniteCheck, k) for k in ("add", "add_loss", "raise_if_any")}
    saved_step = step_module.tree_forward_backward
    for k, fn in saved_check.items():
        setattr(finite.FiniteCheck, k, clock.wrap_check(fn))
    # the main job takes the step from the package (a lazy attribute), bench_trunk from its module
    step_module.tree_forward_backward = megatron_tree.tree_forward_backward = clock.wrap_step(
        saved_step
    )
    path, argv = JOBS[name]
    old_argv = sys.argv
    try:
        sys.argv = [str(path), *argv]
        with contextlib.redirect_stdout(sys.stderr):
            try:
                runpy.run_path(str(path), run_name="__main__")
            except SystemExit as done:  # the main job ends with sys.exit(0)
                if done.code not in (None, 0):
                    raise
    finally:
        sys.argv = old_argv
        for k, fn in saved_check.items():
            setattr(finite.FiniteCheck, k, fn)
        step_module.tree_forward_backward = megatron_tree.tree_forward_backward = saved_step
    if not clock.steps:
        raise RuntimeError(f"{path.name} ran no tree_forward_backward step: nothing was measured")
    return clock


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", choices=["main", "trunk", "both"], default="both")
    args = p.parse_args()
    rows = []
    for name in ["main", "trunk"] if args.job == "both" else [args.job]:
        print(f"[bench_finite] running the {name} job", file=sys.stderr, flush=True)
        clock = run(name)
        step_s = sum(s for s, _ in clock.steps)
        check_s = sum(c for _, c in clock.steps)
        shares = [c / s for s, c in clock.steps if s > 0]
        rows.append(
            (
                name,
                len(clock.steps),
                step_s,
                statistics.median(s for s, _ in clock.steps),
                check_s,
                check_s / step_s,
                max(shares),
            )
        )
    print(
        f"{'job':<6} {'steps':>5} {'steps s':>9} {'median s':>9} {'check s':>9} "
        f"{'share':>8} {'max share':>9}"
    )
    for name, n, step_s, median, check_s, share, worst in rows:
        print(
            f"{name:<6} {n:>5} {step_s:>9.3f} {median:>9.4f} {check_s:>9.5f} "
            f"{share:>8.3%} {worst:>9.3%}"
        )


if __name__ == "__main__":
    main()
