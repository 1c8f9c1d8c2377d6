"""Fixtures shared by test files: Megatron on a one-process gloo world, and tiny HuggingFace
checkpoints with their fp32 references, built once per session (the bridge tests and the GPU tests
read the same ones); and the Hypothesis profiles."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# Hypothesis profiles, chosen by HYPOTHESIS_PROFILE. "ci" (the default) draws the same examples on
# every run and machine, so the property tests gate a merge reproducibly; "wide" draws new random
# examples, WIDE_FACTOR times as many. A test's own @settings override only the values they name.
WIDE_FACTOR = 5
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile(
    "wide", derandomize=False, deadline=None, print_blob=True, max_examples=WIDE_FACTOR * 100
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "wide"):
    raise ValueError(f"HYPOTHESIS_PROFILE={PROFILE!r} must be 'ci' (the default) or 'wide'")
settings.load_profile(PROFILE)


# The "slow" mark (pytest.ini): whole-example runs and spawned worlds of >= 4 processes. CI runs
# everything; `pytest -m "not slow"` is the quick local loop. test_grpo_loop.py (runs
# examples/grpo_loop.py end to end) is marked here, by file, until its own pytestmark carries it.
SLOW_FILES = ("test_grpo_loop.py",)


def _own_module_fixture(item) -> bool:
    """Whether ``item`` uses a module-scoped fixture of its own file (a world run once, its results
    read by the file's tests)."""
    module = item.nodeid.split("::")[0]
    infos = getattr(item, "_fixtureinfo", None)
    defs = infos.name2fixturedefs.values() if infos is not None else ()
    return any(d.scope == "module" and d.baseid == module for chain in defs for d in chain)


@pytest.hookimpl(wrapper=True)  # around the others: before -m deselects and xdist reads groups
def pytest_collection_modifyitems(config, items):
    """Mark the tests of ``SLOW_FILES`` slow; put the tests that share a module-scoped fixture of
    their file in one pytest-xdist group (``--dist loadgroup``, scripts/test.sh), so that one
    worker builds it once instead of every worker; under "wide", scale the max_examples a test
    names too (it overrides the profile's)."""
    grouping = getattr(config.option, "loadgroup", False)  # set in an xdist worker
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
        if grouping and _own_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    _scale_wide_examples(items)
    result = yield
    if grouping:
        _xdist_group_ids(items)
    return result


def _xdist_group_ids(items) -> None:
    """pytest-xdist 3.8 groups a test by suffixing ``@group`` to ``item._nodeid``, which pytest 9
    no longer reads (its id lives in ``item._id``): without this, ``--dist loadgroup`` spreads a
    group's tests over every worker and each builds the group's fixture again."""
    try:
        from _pytest.nodeid import NodeId  # pytest >= 9
    except ImportError:
        return
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{mark.args[0]}")


def _scale_wide_examples(items) -> None:
    if PROFILE != "wide":
        return
    functions = (getattr(item.obj, "__func__", item.obj) for item in items if hasattr(item, "obj"))
    for test in {id(f): f for f in functions}.values():  # a parametrized test once
        own = getattr(test, "_hypothesis_internal_use_settings", None)  # set by @given/@settings
        if own is not None and own.max_examples != settings.default.max_examples:
            scaled = settings(own, max_examples=WIDE_FACTOR * own.max_examples)
            test._hypothesis_internal_use_settings = scaled


@pytest.fixture(scope="module")
def world():
    """Megatron's parallel_state at TP=1 on a one-process gloo world, with the CPU runtime patch
    applied for the module and undone after it."""
    from harness.dist import single_process_world
    from megatron_tree.patches import megatron_cpu

    single_process_world()
    yield
    megatron_cpu.undo()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{arch: path} of a tiny random checkpoint per architecture in ``ARCHS``."""
    from harness.models import make_hf_checkpoints

    return make_hf_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def references(checkpoints):
    """HF fp32 (eager attention, CPU) on each branching sequence alone: {arch: {sequence:
    log-probs}}."""
    from harness.models import branching_sequences, hf_references

    return hf_references(checkpoints, branching_sequences())
