"""The suite's error measures fail on NaN: one NaN or inf anywhere reads as an infinite error, which
Python's ``max()`` keeps and every ``<= tol`` refuses (a plain ``max()`` over per-sequence errors
drops a NaN that is not first, and ``max(0.0, nan)`` is 0.0)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tree.testing.tolerances import (
    LOGP_TOL,
    max_abs_error,
    relative_error,
    worst_error,
)

BAD = [float("nan"), float("inf"), float("-inf")]


def _pair(seed: int, n: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    want = torch.randn(n, generator=gen)
    return want + 1e-6 * torch.randn(n, generator=gen), want


def test_python_max_drops_nan():
    """Why the helpers exist: the pattern they replace passes on NaN."""
    errors = [1e-7, float("nan"), 2e-7]
    assert max(errors) <= LOGP_TOL and max(0.0, float("nan")) == 0.0
    assert not worst_error(errors) <= LOGP_TOL


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", ["got", "want"])
@pytest.mark.parametrize("index", [0, 3, 6])
def test_max_abs_error_is_inf_on_a_non_finite_element(bad, where, index):
    got, want = _pair(index)
    (got if where == "got" else want)[index] = bad
    assert max_abs_error(got, want) == math.inf
    assert max([1e-7, max_abs_error(got, want), 1e-7]) == math.inf  # survives Python's max()


def test_max_abs_error_equals_the_plain_difference_when_finite():
    for seed in range(5):
        got, want = _pair(seed)
        assert max_abs_error(got, want) == float((got - want).abs().max())
        assert 0 < max_abs_error(got, want) <= LOGP_TOL


def test_max_abs_error_refuses_empty_tensors():
    with pytest.raises(ValueError, match="hold no elements"):
        max_abs_error(torch.zeros(0), torch.zeros(0))


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("where", ["got", "want"])
def test_relative_error_is_inf_on_a_non_finite_element(bad, where):
    got, want = _pair(11, n=12)
    (got if where == "got" else want)[5] = bad
    assert relative_error(got.view(3, 4), want.view(3, 4)) == math.inf


def test_relative_error_when_finite():
    got, want = _pair(12)
    expected = float(torch.linalg.vector_norm(got.double() - want.double()))
    expected /= float(torch.linalg.vector_norm(want.double()))
    assert relative_error(got, want) == pytest.approx(expected, rel=1e-5)
    assert relative_error(torch.ones(3), torch.zeros(3)) > 1e20  # a zero reference


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("bad", BAD)
def test_worst_error_is_inf_on_any_non_finite_error(position, bad):
    errors = [1e-7, 2e-7, 3e-7]
    errors[position] = bad
    assert worst_error(errors) == math.inf
    assert worst_error(iter([1e-7, 3e-7, 2e-7])) == 3e-7
    with pytest.raises(ValueError, match="no errors"):
        worst_error([])


def test_gradient_errors_and_max_err_are_inf_on_nan():
    """The shared helpers the parity tests call: one NaN element in any parameter's gradient, or in
    any sequence's log-probs (not only the first), gives an infinite error."""
    from harness.models import max_err
    from megatron_tree.testing.reference import gradient_errors

    gen = torch.Generator().manual_seed(0)
    want = {f"p{i}": torch.randn(4, 3, generator=gen) for i in range(4)}
    got = {name: g + 1e-7 for name, g in want.items()}
    assert max(gradient_errors(got, want).values()) <= 1e-4
    got["p2"][1, 2] = float("nan")
    errors = gradient_errors(got, want)
    assert errors["p2"] == math.inf and max(errors.values()) == math.inf

    want_lp = {i: -torch.rand(5 + i, generator=gen) for i in range(4)}
    got_lp = {i: v.clone() for i, v in want_lp.items()}
    assert max_err(got_lp, want_lp) == 0.0
    got_lp[2][3] = float("nan")
    assert max_err(got_lp, want_lp) == math.inf


def test_error_by_depth_is_inf_at_the_nan_depth():
    """AReaL's per-depth error (it started every depth at 0.0, so ``max(0.0, nan)`` hid a NaN)."""
    from harness.areal import error_by_depth, trie_depths

    seqs = [torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 5, 6, 7]), torch.tensor([1, 8])]
    gen = torch.Generator().manual_seed(0)
    want = {i: -torch.rand(len(s) - 1, generator=gen) for i, s in enumerate(seqs)}
    got = {i: v.clone() for i, v in want.items()}
    assert set(error_by_depth(got, want, seqs).values()) == {0.0}
    got[1][2] = float("nan")
    depth = int(trie_depths(seqs)[1][2])
    errors = error_by_depth(got, want, seqs)
    assert errors[depth] == math.inf
    assert all(e == 0.0 for d, e in errors.items() if d != depth)
