"""Tree attention inside a Megatron GPTModel: depth RoPE, gradients vs unpacked steps, recompute.

References are independent of the tree code: Megatron's own GPTModel with the unmodified local spec
(DotProductAttention, causal mask, positions 0..L-1) run on each sequence alone.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness.models import (
    RECOMPUTE_MODES,
    VOCAB,
    branching_sequences,
    max_err,
    pack,
    packed_logprobs,
    recompute_fields,
)
from megatron_tree.testing.reference import gradient_errors, parameter_grads
from megatron_tree.testing.tolerances import GRAD_RTOL, LOGP_TOL

# A CPU suite: on a CUDA machine Megatron places rotary tables on the GPU while these models live on
# the CPU. Run it there with CUDA_VISIBLE_DEVICES= (scripts/gpu_check.sh does; it checks CUDA
# itself).
pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="CPU suite; run with CUDA_VISIBLE_DEVICES= on CUDA machines",
    ),
    pytest.mark.usefixtures("world"),
]


def _config(**overrides):
    from harness.models import small_gpt_config

    return small_gpt_config(add_qkv_bias=True, init_method_std=0.15, **overrides)


def _model(kind: str, config=None, backend: str = "block_sparse"):
    """kind: "reference" (stock GPTModel, local spec), "plain_rope" (tree attention, stock rope),
    "tree" (tree attention + depth rope)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_tree.mcore.model import TreeGPTModel
    from megatron_tree.mcore.spec import tree_attention_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if kind != "reference":
        spec = tree_attention_spec(spec, backend=backend, block_size=16)
    cls = TreeGPTModel if kind == "tree" else GPTModel
    torch.manual_seed(0)
    return cls(
        config=config or _config(),
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=512,
        position_embedding_type="rope",
    )


def _reference_logprobs(model, seqs) -> dict[int, torch.Tensor]:
    out = {}
    for i, s in enumerate(seqs):
        logits = model(s[None], torch.arange(len(s))[None], attention_mask=None)
        out[i] = torch.log_softmax(logits[0], -1)[:-1].gather(1, s[1:, None])[:, 0]
    return out


def _tree_logprobs(model, micro_batches, mask_form: str = "subtree_end") -> dict[int, torch.Tensor]:
    from megatron_tree.core.mask import build_attention_mask_from_trie, tree_attention_mask

    out = {}
    for mb in micro_batches:
        tree = mb["tree"]
        mask = (
            tree_attention_mask(tree)
            if mask_form == "subtree_end"
            else build_attention_mask_from_trie(tree)
        )
        logits = model(mb["input_ids"], mb["position_ids"], attention_mask=mask)
        out.update(packed_logprobs(logits, mb))
    return out


def test_depth_rope_is_needed_for_branches():
    """With Megatron's plain rope the later branches are off by far more than the tolerance; with
    depth RoPE every sequence matches its unpacked run."""
    seqs = branching_sequences()
    micro_batches = pack(seqs)
    reference = _model("reference").eval()
    state = reference.state_dict()
    with torch.no_grad():
        ref = _reference_logprobs(reference, seqs)
        plain = _model("plain_rope").eval()
        plain.load_state_dict(state)
        depth = _model("tree").eval()
        depth.load_state_dict(state)
        plain_err = max_err(_tree_logprobs(plain, micro_batches), ref)
        depth_err = max_err(_tree_logprobs(depth, micro_batches), ref)
        dense_err = max_err(_tree_logprobs(depth, micro_batches, "dense"), ref)
    assert 1e-2 < plain_err < math.inf, plain_err  # far off, but not NaN/inf (max_err: inf)
    assert depth_err <= LOGP_TOL, depth_err
    assert dense_err <= LOGP_TOL, dense_err


def _weights(seqs) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {i: torch.rand(len(s) - 1, generator=g) for i, s in enumerate(seqs)}


def _loss(logprobs: dict, weights: dict) -> torch.Tensor:
    return -sum((logprobs[i] * weights[i]).sum() for i in logprobs)


@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
@pytest.mark.parametrize("backend,mask_form", [("block_sparse", "subtree_end"), ("sdpa", "dense")])
def test_tree_gradients_equal_unpacked_gradients(recompute, backend, mask_form):
    """One tree-packed step vs. the sum of per-sequence unpacked steps, same per-token loss."""
    seqs = branching_sequences()
    micro_batches = pack(seqs)
    weights = _weights(seqs)

    reference = _model("reference").train()
    _loss(_reference_logprobs(reference, seqs), weights).backward()
    want = parameter_grads(reference, require_all=True)

    tree = _model("tree", _config(**recompute_fields(recompute)), backend=backend).train()
    tree.load_state_dict(reference.state_dict())
    _loss(_tree_logprobs(tree, micro_batches, mask_form), weights).backward()
    errors = gradient_errors(parameter_grads(tree, require_all=True), want)
    assert max(errors.values()) <= GRAD_RTOL, max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_builds_the_tree_mask_once_per_micro_batch(monkeypatch, recompute):
    """Two micro-batches in flight, as under a pipeline schedule: forward 1, forward 2, then the
    backward of 1 (which recomputes its layers) and of 2. Each micro-batch derives its block-sparse
    plan once (2 layers forward + 2 recomputed share it), and each backward uses its own plan:
    the gradients equal those of running the micro-batches one after the other."""
    from megatron_tree.core import mask as tree_mask
    from megatron_tree.core.mask import tree_attention_mask

    calls = []
    original = tree_mask.block_sparse_plan
    monkeypatch.setattr(
        tree_mask, "block_sparse_plan", lambda *a, **kw: calls.append(1) or original(*a, **kw)
    )
    micro_batches = pack(branching_sequences(), max_tokens=64)[:2]
    assert (
        len(micro_batches) == 2
        and micro_batches[0]["tree"].padded_length == micro_batches[1]["tree"].padded_length
    )
    model = _model("tree", _config(**recompute_fields(recompute))).train()

    def forward(mb):
        logits = model(
            mb["input_ids"], mb["position_ids"], attention_mask=tree_attention_mask(mb["tree"])
        )
        return logits.log_softmax(-1)[..., 3].sum()

    in_flight = [forward(mb) for mb in micro_batches]
    for loss in in_flight:
        loss.backward()
    interleaved = parameter_grads(model, require_all=True)
    assert len(calls) == 2
    model.zero_grad()
    for mb in micro_batches:
        forward(mb).backward()
    for name, grad in parameter_grads(model, require_all=True).items():
        torch.testing.assert_close(interleaved[name], grad, rtol=0, atol=1e-6)


def test_core_attention_module_errors():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_tree.mcore.core_attention import TreeCoreAttention

    config = _config()
    with pytest.raises(
        ValueError, match="layer 3: tree attention needs attn_mask_type=AttnMaskType.arbitrary"
    ):
        TreeCoreAttention(config, 3, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match="backend='fast'"):
        TreeCoreAttention(config, 1, AttnMaskType.arbitrary, "self", backend="fast")
    module = TreeCoreAttention(config, 1, AttnMaskType.arbitrary, "self")
    q = torch.randn(32, 1, 4, 16)
    kv = torch.randn(32, 1, 2, 16)
    with pytest.raises(ValueError, match=r"shape \(16, 16\) but the packed sequence has 32 query"):
        module(q, kv, kv, torch.zeros(16, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="packed_seq_params"):
        module(q, kv, kv, torch.arange(1, 33), packed_seq_params=object())
    # Under context parallelism a plain encoding (no split) cannot say which rows this rank holds.
    cp_module = TreeCoreAttention(
        _config(context_parallel_size=2), 1, AttnMaskType.arbitrary, "self"
    )
    with pytest.raises(ValueError, match="context_parallel_size=2 needs the tree mask of a 2-way"):
        cp_module(q, kv, kv, torch.arange(1, 33))


def test_attention_dropout_draws_from_the_model_parallel_rng():
    """With attention dropout the module forks Megatron's model-parallel RNG tracker (the heads on
    each TP rank must drop independently): the default generator is left untouched, and reseeding
    the tracker reproduces the output."""
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_tree.core.mask import tree_attention_mask
    from megatron_tree.mcore.core_attention import TreeCoreAttention

    tree = pack(branching_sequences())[0]["tree"]
    n = tree.padded_length
    g = torch.Generator().manual_seed(0)
    q, kv = torch.randn(n, 1, 4, 16, generator=g), torch.randn(n, 1, 2, 16, generator=g)
    module = TreeCoreAttention(
        _config(attention_dropout=0.5),
        1,
        AttnMaskType.arbitrary,
        "self",
        backend="block_sparse",
        block_size=16,
    ).train()
    mp_random.model_parallel_cuda_manual_seed(77)
    default_state = torch.get_rng_state()
    first = module(q, kv, kv, tree_attention_mask(tree))
    assert torch.equal(torch.get_rng_state(), default_state)
    mp_random.model_parallel_cuda_manual_seed(77)
    assert torch.equal(module(q, kv, kv, tree_attention_mask(tree)), first)
    assert not torch.equal(module.eval()(q, kv, kv, tree_attention_mask(tree)), first)


def test_position_range_is_checked_only_in_debug_mode():
    """Depth RoPE reads the position range only with debug checks on (it costs a host sync); the
    error then names position_ids and the real range, negative values included."""
    from megatron_tree.core.checks import set_debug_checks
    from megatron_tree.core.rope import depth_rotary_pos_emb

    table = torch.randn(8, 1, 1, 4)
    bad = torch.tensor([[0, 1, -1, 2]])
    assert depth_rotary_pos_emb(table, torch.tensor([[0, 1, 1, 2]])).shape == (4, 1, 1, 4)
    set_debug_checks(True)
    try:
        with pytest.raises(
            ValueError, match=r"position_ids must lie in \[0, 8\) .* got values in \[-1, 2\]"
        ):
            depth_rotary_pos_emb(table, bad)
        with pytest.raises(ValueError, match=r"got values in \[0, 9\]"):
            depth_rotary_pos_emb(table, torch.tensor([[0, 9]]))
    finally:
        set_debug_checks(False)
