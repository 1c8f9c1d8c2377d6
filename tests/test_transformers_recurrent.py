"""HF's recurrent mixers on packed trees (``megatron_tree.integrations.transformers_recurrent``).

``prepare_model`` swaps the gated delta-nets of Qwen3-Next / Qwen3.5 / Qwen3.5-MoE and the Mamba-2
mixers of Nemotron-H (dense and MoE) for tree modules. Reference: HuggingFace's own model (eager) on
the sequences as one right-padded batch, each row its sequence alone (Nemotron-H in one scan chunk:
``testing.reference.one_mamba_chunk``), for log-probs and every parameter's gradient of a fixed
random per-token loss; Qwen3-Next and Nemotron-H also with HF's gradient checkpointing on
(non-reentrant and reentrant: the recomputation must get the tree mask again). Sequences: the tries
a recurrent layer gets wrong first (``recurrent_sequences``: one- and two-token segments between
branch points, a branch at a root's first token, a ladder of one-token segments) plus a prompt
group whose shared prompt spans several of Nemotron-H's 16-token scan chunks, a prefix and a
duplicate; packed into two micro-batches. Runs on the Megatron-Bridge stack (transformers 5.12);
a family this transformers lacks is skipped by name.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from harness.marks import CPU_SUITE
from harness.models import (
    MAMBA_CASES,
    make_hf_checkpoint,
    record_parity,
    recurrent_sequences,
)
from megatron_tree import build_packed_tree_batch
from megatron_tree.core import mask as mask_module
from megatron_tree.core.mask import tree_attention_mask
from megatron_tree.core.recurrent import RecurrentPlan
from megatron_tree.testing.reference import one_mamba_chunk
from megatron_tree.testing.tolerances import GRAD_RTOL, HF_HYBRID_LOGP_TOL, LOGP_TOL

transformers = pytest.importorskip("transformers")
from megatron_tree.integrations.transformers import packed_logprobs, prepare_model  # noqa: E402

pytestmark = CPU_SUITE

# case -> (arch for make_hf_checkpoint, config overrides, HF modeling module, log-prob bar). The
# gated delta-net hybrids' bar is HF_HYBRID_LOGP_TOL: HF's own fp32 log-probs move by up to 7.6e-6
# against its fp64 run there (its delta rule stays fp32); Nemotron-H's scan is plain fp32.
CASES = {
    "qwen3_next": ("qwen3_next", {}, "qwen3_next", HF_HYBRID_LOGP_TOL),
    "qwen3_5_text": ("qwen3_5_text", {}, "qwen3_5", HF_HYBRID_LOGP_TOL),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", {}, "qwen3_5_moe", HF_HYBRID_LOGP_TOL),
    **{name: (arch, over, "nemotron_h", LOGP_TOL) for name, (arch, over) in MAMBA_CASES.items()},
}
# Cases run with HF's gradient checkpointing on the tree model: {case: use_reentrant} (False is
# HF's default).
CHECKPOINTED = {"qwen3_next": False, "nemotron_h": True}
# Several micro-batches of at most 64 tokens (tiles of 16).
PACKING = dict(max_tokens_per_mb=64, block_size=16, share_trunks=False)


def _has(module: str) -> bool:
    return importlib.util.find_spec(f"transformers.models.{module}") is not None


def _case(name: str):
    module = CASES[name][2]
    return pytest.param(
        name,
        marks=pytest.mark.skipif(
            not _has(module), reason=f"transformers {transformers.__version__} has no {module}"
        ),
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(case)`` -> path of the case's tiny random checkpoint, made once per module."""
    root, paths = tmp_path_factory.mktemp("hf_recurrent"), {}

    def get(name: str) -> str:
        if name not in paths:
            arch, overrides, _, _ = CASES[name]
            paths[name] = str(root / name)
            make_hf_checkpoint(arch, paths[name], **overrides)
        return paths[name]

    return get


def _sequences() -> list[torch.Tensor]:
    """The recurrent tries, and from the branching ones: two rollouts of a 24-token prompt (33 and
    41 tokens), the prompt's first 15 tokens (a sequence ending inside a segment) and a
    duplicate."""
    seqs = recurrent_sequences()
    return seqs[:2] + seqs[11:]


def _weights(seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A fixed random weight per log-prob entry (a sequence's last entry has none)."""
    g = torch.Generator().manual_seed(3)
    return [torch.randn(len(s) - 1, generator=g) for s in seqs]


def _models(path: str):
    """(HF eager reference, a prepared copy with the same weights)."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return reference, prepare_model(copy.deepcopy(reference))


def _hf_step(model, seqs, weights) -> list[torch.Tensor]:
    """HF's stock path on ``seqs`` as one right-padded batch (each row its sequence alone: HF's
    padding mask in attention, and the scans run left to right, so padding cannot reach a real
    token; 15 sequences one by one cost 8-15x more CPU here): log-probs [L-1] per sequence;
    sum(weight * log-prob) backpropagated."""
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask, w = torch.zeros_like(ids), torch.zeros(len(seqs), longest - 1)
    for i, (s, weight) in enumerate(zip(seqs, weights)):
        ids[i, : len(s)], mask[i, : len(s)], w[i, : len(s) - 1] = s, 1, weight
    with one_mamba_chunk(model, longest):  # exact Mamba-2 reference (no-op for the others)
        logits = model(ids, attention_mask=mask).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(2, ids[:, 1:, None])[..., 0]
    (w * lp).sum().backward()
    return [lp[i, : len(s) - 1].detach() for i, s in enumerate(seqs)]


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _max_grad_rel(got: dict, want: dict) -> float:
    """Largest ``|got - want| / |want|`` over the parameters (each parameter's gradient norm)."""
    from megatron_tree.testing.tolerances import relative_error, worst_error

    assert got.keys() == want.keys() and want, sorted(got.keys() ^ want.keys())
    return worst_error(relative_error(got[n], w) for n, w in want.items())


class _CountingPlan(RecurrentPlan):
    """A RecurrentPlan that counts how many are built."""

    built = 0

    def __init__(self, subtree_end):
        type(self).built += 1
        super().__init__(subtree_end)


@pytest.mark.parametrize("name", [_case(n) for n in CASES])
def test_tree_mixers_match_hf_on_each_sequence(name, checkpoint, monkeypatch, record_property):
    """Log-probs and every parameter's gradient vs HF per sequence; one segment plan per
    micro-batch for all layers (and the recomputation, where checkpointing is on)."""
    seqs = _sequences()
    weights = _weights(seqs)
    reference, model = _models(checkpoint(name))
    mixers = [m for m in model.modules() if getattr(m, "is_tree_module", False)]
    assert len(mixers) >= 2, [type(m).__name__ for m in model.modules()]
    checkpointed = name in CHECKPOINTED
    if checkpointed:
        reentrant = {"use_reentrant": CHECKPOINTED[name]}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=reentrant)
        model.train()  # HF checkpoints only in training mode (dropout is 0 in these configs)
    calls = []
    # A pre-hook: non-reentrant recomputation stops once it has what backward needs, which can be
    # before a mixer's forward returns (Nemotron-H's last op with saved inputs is its out_proj).
    mixers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    monkeypatch.setattr(mask_module, "RecurrentPlan", _CountingPlan)
    _CountingPlan.built = 0

    want = _hf_step(reference, seqs, weights)
    batch = build_packed_tree_batch({"input_ids": seqs}, **PACKING)
    micro_batches = len(list(batch))
    assert micro_batches >= 2
    lps = packed_logprobs(model, batch).logprobs
    sum((w * lp[:-1]).sum() for w, lp in zip(weights, lps)).backward()

    # Forward, and the recomputation in backward under checkpointing, each entered the tree mixer.
    assert len(calls) == micro_batches * (2 if checkpointed else 1)
    assert _CountingPlan.built == micro_batches
    from megatron_tree.testing.tolerances import max_abs_error, worst_error

    err = worst_error(max_abs_error(lp[:-1], w) for lp, w in zip(lps, want))
    grad_rel = _max_grad_rel(_grads(model), _grads(reference))
    record_property("logprob_err", f"{err:.2e}")
    record_property("grad_rel", f"{grad_rel:.2e}")
    record_parity(name, "transformers", err, engine="hf", max_grad_rel=grad_rel)
    assert err <= CASES[name][3], err
    assert grad_rel <= GRAD_RTOL, grad_rel


@pytest.mark.parametrize("name", [_case("qwen3_next"), _case("nemotron_h")])
def test_swap_keeps_the_parameters(name, checkpoint):
    """The swapped model holds the same parameter tensors under the same names; prepare_model is
    idempotent; a call without the tree, or with a cache, is refused with the fix."""
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(name), dtype=torch.float32)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    stock = sum(1 for m in model.modules() if type(m).__name__.endswith(("DeltaNet", "Mixer")))
    from megatron_tree.integrations.transformers_recurrent import swap_recurrent_modules

    assert swap_recurrent_modules(model) == stock >= 2
    assert swap_recurrent_modules(model) == 0
    prepare_model(model)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before
    mb = next(iter(build_packed_tree_batch({"input_ids": _sequences()[:2]}, **PACKING)))
    with pytest.raises(ValueError, match="tree_mask"):
        model(mb.input_ids, position_ids=mb.position_ids, use_cache=False)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(
            mb.input_ids,
            position_ids=mb.position_ids,
            tree_mask=tree_attention_mask(mb.rows),
            use_cache=True,
        )


@pytest.mark.skipif(
    not _has("qwen3_5"), reason=f"transformers {transformers.__version__} has no qwen3_5"
)
def test_qwen3_5_vision_language_model_on_text(record_property):
    """Qwen3.5's vision-language model (model type ``qwen3_5``: the text model inside
    ``Qwen3_5ForConditionalGeneration``, multimodal rotary over depth positions) on text rollouts:
    log-probs and gradients vs HF as above."""
    from harness.models import HYBRID_TINY

    text = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        **HYBRID_TINY["qwen3_5_text"],
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = transformers.AutoConfig.for_model("qwen3_5", text_config=text, vision_config=vision)
    torch.manual_seed(0)
    reference = transformers.Qwen3_5ForConditionalGeneration(config).float()
    # Drawn as make_hf_checkpoint draws the hybrids. With HF's own init (A up to 16: decays of
    # e^-16 per token), HF's fp32 gradients of A_log / dt_bias err by 1.5e-4 against an exact fp64
    # delta rule (the tree's by 6.4e-5), above GRAD_RTOL for rounding alone.
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith("norm.weight"):  # zero-centered (1 + weight) but the gated norm's
                shift = 0.0 if name.endswith("linear_attn.norm.weight") else 1.0
                p.uniform_(0.6 - shift, 1.4 - shift)
            else:
                p.normal_(0.0, 0.1 if p.dim() >= 2 else 0.2)
    reference.set_attn_implementation("eager")
    model = prepare_model(copy.deepcopy(reference))
    seqs = _sequences()
    weights = _weights(seqs)
    want = _hf_step(reference, seqs, weights)
    batch = build_packed_tree_batch({"input_ids": seqs}, **PACKING)
    lps = packed_logprobs(model, batch).logprobs
    sum((w * lp[:-1]).sum() for w, lp in zip(weights, lps)).backward()
    from megatron_tree.testing.tolerances import max_abs_error, worst_error

    err = worst_error(max_abs_error(lp[:-1], w) for lp, w in zip(lps, want))
    grad_rel = _max_grad_rel(_grads(model), _grads(reference))
    record_property("logprob_err", f"{err:.2e}")
    record_property("grad_rel", f"{grad_rel:.2e}")
    record_parity("qwen3_5", "transformers", err, engine="hf", max_grad_rel=grad_rel)
    assert err <= HF_HYBRID_LOGP_TOL, err
    assert grad_rel <= GRAD_RTOL, grad_rel


# Recurrent families without a tree module: (model type, tiny config fields, the module named in
# the refusal). Jamba: Mamba-1; Bamba and Falcon-H1: Mamba-2 mixers whose names lack "Mamba".
UNSWAPPABLE = {
    "jamba": (
        dict(
            num_experts=1,
            expert_layer_period=1,
            expert_layer_offset=0,
            attn_layer_period=2,
            attn_layer_offset=1,
            mamba_d_state=4,
            mamba_expand=1,
        ),
        "JambaMambaMixer",
    ),
    "bamba": (
        dict(
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=8,
            mamba_expand=1,
            attn_layer_indices=[1],
        ),
        "BambaMixer",
    ),
    "falcon_h1": (
        dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_d_ssm=64),
        "FalconH1Mixer",
    ),
}


@pytest.mark.parametrize(
    "model_type",
    [
        pytest.param(t, marks=pytest.mark.skipif(not _has(t), reason=f"transformers lacks {t}"))
        for t in UNSWAPPABLE
    ],
)
def test_unswappable_recurrent_families_are_refused_by_name(model_type):
    """A model with recurrent mixers that have no tree module is refused, the module named."""
    fields, module = UNSWAPPABLE[model_type]
    config = transformers.AutoConfig.for_model(
        model_type,
        vocab_size=128,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_mamba_kernels=False,
        **fields,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError) as refusal:
        prepare_model(model)
    if "attention interface" in str(refusal.value):  # refused before its mixers are looked at
        pytest.skip(f"{model_type} on transformers {transformers.__version__}: {refusal.value}")
    assert module in str(refusal.value), refusal.value
