"""Fixtures shared by test files: Megatron on a one-process gloo world, and tiny HuggingFace
checkpoints with their fp32 references, built once per session (the bridge tests and the GPU tests
read the same ones)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def world():
    """Megatron's parallel_state at TP=1 on a one-process gloo world, with the CPU runtime patch
    applied for the module and undone after it."""
    from megatron_tree.patches import megatron_cpu
    from megatron_tree.testing.dist import single_process_world

    single_process_world()
    yield
    megatron_cpu.undo()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{arch: path} of a tiny random checkpoint per architecture in ``ARCHS``."""
    from megatron_tree.testing.models import make_hf_checkpoints

    return make_hf_checkpoints(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def references(checkpoints):
    """HF fp32 (eager attention, CPU) on each branching sequence alone: {arch: {sequence: log-probs}}."""
    from megatron_tree.testing.models import branching_sequences, hf_logprobs

    seqs = branching_sequences()
    return {arch: hf_logprobs(path, seqs) for arch, path in checkpoints.items()}
