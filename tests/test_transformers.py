"""HF models on packed trees (``megatron_tree.integrations.transformers``) against HF itself.

Every reference is HuggingFace's own model (eager attention) run on each sequence alone: log-probs,
entropies, values and every parameter's gradient of a fixed random per-token loss. The tree runs a
copy of the same model, prepared with ``prepare_model``, on ``branching_sequences()`` packed into
two micro-batches (shared prompt, multi-turn chain, prefixes, a duplicate). Families: every
attention-only family of ``FAMILIES`` that this stack's transformers has (4.57 and 5.12) and whose
modeling code uses transformers' attention interface there (Qwen2-MoE in 4.57 does not: refused).
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from packaging.version import Version

from harness.marks import CPU_SUITE
from harness.models import (
    FRONTIER_TINY,
    branching_sequences,
    make_hf_checkpoint,
    record_parity,
    trunk_sequences,
)
from megatron_tree import build_packed_tree_batch
from megatron_tree.testing.tolerances import BF16_FACTOR, GRAD_RTOL, LOGP_TOL

transformers = pytest.importorskip("transformers")
from megatron_tree.integrations.transformers import (  # noqa: E402
    ATTENTION_KEY,
    TreeAttentionOptions,
    packed_logprobs,
    prepare_model,
    tree_forward,
)

pytestmark = CPU_SUITE

FAMILIES = (
    "qwen2",
    "qwen3",
    "llama",
    "qwen3_moe",
    "qwen2_moe",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
)
# Two micro-batches of at most 96 tokens (tiles of 16): the tries are cut and merged back.
PACKING = dict(max_tokens_per_mb=96, block_size=16, share_trunks=False)
transformers_version = Version(transformers.__version__).release
# Families whose HF modeling code uses the attention interface only from a transformers version on
# (Qwen2-MoE's attention classes pick their own kernels in 4.57).
INTERFACE_SINCE = {"qwen2_moe": (5,)}


def _skip(arch: str) -> str | None:
    if importlib.util.find_spec(f"transformers.models.{arch}") is None:
        return f"no {arch} in transformers {transformers.__version__}"
    if transformers_version < INTERFACE_SINCE.get(arch, ()):
        return f"{arch} in transformers {transformers.__version__} has no attention interface"
    return None


FAMILY_PARAMS = [
    pytest.param(arch, marks=pytest.mark.skipif(_skip(arch) is not None, reason=str(_skip(arch))))
    for arch in FAMILIES
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(arch)`` -> path of a tiny random ``arch`` checkpoint, made once per module."""
    root, paths = tmp_path_factory.mktemp("hf_tree"), {}

    def get(arch: str) -> str:
        if arch not in paths:
            paths[arch] = str(root / arch)
            make_hf_checkpoint(arch, paths[arch])
        return paths[arch]

    return get


def _models(path: str, *, auto=None, dtype=torch.float32, **kwargs):
    """(HF eager reference, prepared copy with the same weights)."""
    auto = auto or transformers.AutoModelForCausalLM
    torch.manual_seed(0)  # a value head not in the checkpoint is drawn the same way every run
    reference = auto.from_pretrained(path, dtype=dtype, attn_implementation="eager", **kwargs)
    return reference, prepare_model(copy.deepcopy(reference))


def _weights(seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A fixed random weight per log-prob entry (the last entry of a sequence has none)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randn(len(s) - 1, generator=g) for s in seqs]


def _reference(model, seqs, weights=None, *, temperature=1.0):
    """HF on each sequence alone: (log-probs [L-1] per sequence, entropies [L] per sequence);
    with ``weights``, sum(weight * log-prob) over every sequence is backpropagated."""
    lps, ents = [], []
    for i, s in enumerate(seqs):
        logits = model(s[None]).logits[0].float() / temperature
        logp = torch.log_softmax(logits, -1)
        lp = logp[:-1].gather(1, s[1:, None])[:, 0]
        if weights is not None:
            (weights[i] * lp).sum().backward()
        lps.append(lp.detach())
        ents.append(-(logp.exp() * logp).sum(-1).detach())
    return lps, ents


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_grad_rel(got: dict, want: dict) -> float:
    """Largest ``|got - want| / |want|`` over the parameters (norms of each parameter's grad)."""
    assert got.keys() == want.keys() and want, (sorted(got.keys() ^ want.keys()), len(want))
    from megatron_tree.testing.tolerances import worst_error

    errors = []
    for name, w in want.items():
        diff = float((got[name] - w).norm())
        scale = float(w.norm())
        errors.append(diff / scale if scale > 0 else diff)  # NaN stays NaN: worst_error -> inf
    return worst_error(errors)


def _tree_step(model, seqs, weights, **kwargs):
    """packed_logprobs on the list layout, sum(weight * log-prob) backpropagated; log-probs [L-1]
    per sequence."""
    batch = build_packed_tree_batch({"input_ids": seqs}, **PACKING)
    assert len(list(batch)) >= 2
    lps = packed_logprobs(model, batch, **kwargs).logprobs
    sum((w * lp[:-1]).sum() for w, lp in zip(weights, lps)).backward()
    return [lp[:-1].detach() for lp in lps]


def _max_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    from megatron_tree.testing.tolerances import max_abs_error, worst_error

    assert [g.shape for g in got] == [w.shape for w in want]
    return worst_error(max_abs_error(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("arch", FAMILY_PARAMS)
def test_logprobs_and_grads_match_hf_on_each_sequence(arch, checkpoint, record_property):
    """Per-sequence log-probs (fp32 bar) and every parameter's gradient (relative bar)."""
    seqs, weights = branching_sequences(), _weights(branching_sequences())
    reference, model = _models(checkpoint(arch))
    if arch == "gpt_oss":  # the window must cut into the sequences, or it is never exercised
        window = FRONTIER_TINY["gpt_oss"]["sliding_window"]
        assert model.config.sliding_window == window < max(len(s) for s in seqs) // 2
    want, _ = _reference(reference, seqs, weights)
    got = _tree_step(model, seqs, weights)
    err = _max_err(got, want)
    grad_rel = _max_grad_rel(_grads(model), _grads(reference))
    record_property("logprob_err", f"{err:.2e}")
    record_property("grad_rel", f"{grad_rel:.2e}")
    record_parity(arch, "transformers", err, engine="hf", max_grad_rel=grad_rel)
    assert err <= LOGP_TOL, err
    assert grad_rel <= GRAD_RTOL, grad_rel


def _thd(seqs):
    lengths = torch.tensor([0] + [len(s) for s in seqs])
    return {"input_ids": torch.cat(seqs), "cu_seqlens": lengths.cumsum(0)}


def test_ragged_layouts_and_entropy_come_back_in_the_callers_layout(checkpoint):
    """Padded [B, L], a list of [L_b] and THD [T] with cu_seqlens give the same per-sequence
    log-probs and entropies (temperature 0.7) as HF on each sequence alone, in the input's
    layout."""
    seqs = branching_sequences()
    reference, model = _models(checkpoint("qwen3"))
    with torch.no_grad():
        want_lp, want_ent = _reference(reference, seqs, temperature=0.7)
        lengths = [len(s) for s in seqs]
        padded = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(padded)
        for i, s in enumerate(seqs):
            padded[i, : len(s)], mask[i, : len(s)] = s, 1
        layouts = {
            "padded": {"input_ids": padded, "attention_mask": mask},
            "list": {"input_ids": seqs},
            "thd": _thd(seqs),
        }
        for kind, data in layouts.items():
            batch = build_packed_tree_batch(data, **PACKING)
            out = packed_logprobs(model, batch, temperature=0.7, entropy=True)
            if kind == "padded":
                assert out.logprobs.shape == out.entropy.shape == (len(seqs), max(lengths))
                lps = [out.logprobs[i, :n] for i, n in enumerate(lengths)]
                ents = [out.entropy[i, :n] for i, n in enumerate(lengths)]
            elif kind == "list":
                assert isinstance(out.logprobs, list) and isinstance(out.entropy, list)
                lps, ents = out.logprobs, out.entropy
            else:
                assert out.logprobs.shape == out.entropy.shape == (sum(lengths),)
                lps, ents = out.logprobs.split(lengths), out.entropy.split(lengths)
            assert [len(x) for x in lps] == [len(x) for x in ents] == lengths, kind
            assert all(float(lp[-1]) == 0.0 for lp in lps), kind  # no token after the last
            assert _max_err([lp[:-1] for lp in lps], want_lp) <= LOGP_TOL, kind
            assert _max_err(list(ents), want_ent) <= LOGP_TOL, kind


def test_value_model_matches_hf_per_sequence(checkpoint):
    """A critic as verl and TRL build it (AutoModelForTokenClassification, num_labels=1):
    ``packed_logprobs(values=True)`` values and gradients vs HF on each sequence alone."""
    seqs = branching_sequences()
    auto = transformers.AutoModelForTokenClassification
    reference, model = _models(checkpoint("qwen2"), auto=auto, num_labels=1)
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(len(s), generator=g) for s in seqs]
    want = []
    for w, s in zip(weights, seqs):
        v = reference(s[None]).logits[0, :, 0]
        (w * v).sum().backward()
        want.append(v.detach())
    batch = build_packed_tree_batch({"input_ids": seqs}, **PACKING)
    got = packed_logprobs(model, batch, values=True).values
    sum((w * v).sum() for w, v in zip(weights, got)).backward()
    assert _max_err([v.detach() for v in got], want) <= LOGP_TOL
    grad_rel = _max_grad_rel(_grads(model), _grads(reference))
    assert grad_rel <= GRAD_RTOL, grad_rel


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_grads(use_reentrant, checkpoint):
    """HF's gradient checkpointing recomputes each layer with the tree mask from the forward's
    kwargs: the same log-probs and gradients as HF on each sequence alone (no checkpointing)."""
    seqs, weights = branching_sequences(), _weights(branching_sequences())
    reference, model = _models(checkpoint("qwen3_moe"))
    kwargs = {"use_reentrant": use_reentrant}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()  # HF checkpoints only in training mode (dropout is 0 in these configs)
    calls = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: calls.append(1))
    want, _ = _reference(reference, seqs, weights)
    got = _tree_step(model, seqs, weights)
    assert len(calls) == 2 * 2  # two micro-batches, each layer run again in the backward
    assert _max_err(got, want) <= LOGP_TOL
    grad_rel = _max_grad_rel(_grads(model), _grads(reference))
    assert grad_rel <= GRAD_RTOL, grad_rel


def test_bf16_tree_errs_at_most_twice_plain_bf16(checkpoint):
    """bf16 tree vs the fp32 per-sequence reference: at most ``BF16_FACTOR`` times the error of HF
    itself in bf16 on each sequence alone (tolerances.py)."""
    seqs = branching_sequences()
    path = checkpoint("qwen3")
    fp32, _ = _models(path)
    plain, model = _models(path, dtype=torch.bfloat16)
    with torch.no_grad():
        want, _ = _reference(fp32, seqs)
        alone, _ = _reference(plain, seqs)
        batch = build_packed_tree_batch({"input_ids": seqs}, **PACKING)
        got = [lp[:-1] for lp in packed_logprobs(model, batch).logprobs]
    tree_err, alone_err = _max_err(got, want), _max_err(alone, want)
    assert 0 < alone_err < float("inf") and tree_err <= BF16_FACTOR * alone_err, (
        tree_err,
        alone_err,
    )


@pytest.mark.slow
def test_torch_compile_of_the_model_gives_the_same_logprobs_and_grads(checkpoint):
    """``torch.compile(model)`` after ``prepare_model``, then packed_logprobs and a backward: the
    same log-probs and gradients as HF eager on each sequence alone. AOTAutograd traces forward and
    backward (``aot_eager``: Inductor's C++ code generation adds ~70 s on 2 CPU cores and checks
    nothing of ours); the mask plan's data-dependent steps run as graph breaks."""
    seqs, weights = branching_sequences(), _weights(branching_sequences())
    reference, model = _models(checkpoint("qwen2"))
    want, _ = _reference(reference, seqs, weights)
    batch = build_packed_tree_batch(
        {"input_ids": seqs}, max_tokens_per_mb=256, block_size=16, share_trunks=False
    )
    compiled = torch.compile(model, backend="aot_eager")
    lps = packed_logprobs(compiled, batch).logprobs
    sum((w * lp[:-1]).sum() for w, lp in zip(weights, lps)).backward()
    assert _max_err([lp[:-1].detach() for lp in lps], want) <= LOGP_TOL
    grad_rel = _max_grad_rel(_grads(model), _grads(reference))
    assert grad_rel <= GRAD_RTOL, grad_rel


@pytest.mark.skipif(
    transformers_version >= INTERFACE_SINCE["qwen2_moe"], reason="Qwen2-MoE has the interface here"
)
def test_a_model_without_the_attention_interface_is_refused(checkpoint):
    """Qwen2-MoE in transformers 4.57 picks its own attention kernels: a ValueError, never a run
    with its own attention over a packed tree (which would attend across branches). Today the
    error comes from the first forward (``set_attn_implementation`` only logs a warning there)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint("qwen2_moe"), dtype=torch.float32
    )
    batch = build_packed_tree_batch({"input_ids": branching_sequences()}, **PACKING)
    with pytest.raises(ValueError, match="attention interface|prepare_model"):
        packed_logprobs(prepare_model(model), batch)


def test_refusals_name_the_fix(checkpoint):
    seqs = branching_sequences()
    reference, model = _models(checkpoint("llama"))
    batch = build_packed_tree_batch({"input_ids": seqs}, **PACKING)
    mb = next(iter(batch))
    with pytest.raises(ValueError, match="prepare_model"):
        packed_logprobs(reference, batch)  # not prepared: eager attention would ignore the tree
    with pytest.raises(ValueError, match="attention_mask"):
        tree_forward(model, mb, attention_mask=torch.ones_like(mb.input_ids))
    with pytest.raises(ValueError, match="backend"):
        TreeAttentionOptions(backend="no-such-backend")
    trunk = build_packed_tree_batch(
        {"input_ids": trunk_sequences()}, max_tokens_per_mb=64, block_size=16, share_trunks=True
    )
    assert not all(m.rows.is_whole for m in trunk)
    with pytest.raises(ValueError, match="share_trunks=False"):
        packed_logprobs(model, trunk)
    assert model.config._attn_implementation == ATTENTION_KEY
