"""Depth RoPE as a rotary module (:mod:`megatron_tree.mcore.rotary`), and the refusal of a model
whose rotary follows packed offsets.

References are independent of the tree code: Megatron's stock GPTModel (local spec, causal mask,
positions 0..L-1) on each sequence alone.
"""

from __future__ import annotations

import pytest
import torch

from harness.models import (
    VOCAB,
    max_err,
    small_gpt_config,
    step_logprobs,
    tree_logprobs,
)
from megatron_tree.testing.tolerances import LOGP_TOL

pytestmark = [
    pytest.mark.skipif(
        torch.cuda.is_available(),
        reason="CPU suite; run with CUDA_VISIBLE_DEVICES= on CUDA machines",
    ),
    pytest.mark.usefixtures("world"),
]

# GPT-level YaRN as Megatron-Bridge's gpt-oss provider sets it (fields GPTModel reads off the
# config); x4 over 16 original positions, so the tree's depths reach far past the ramp.
_YARN = dict(
    yarn_rotary_scaling_factor=4.0,
    yarn_original_max_position_embeddings=16,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
    yarn_mscale=1.0,
    yarn_mscale_all_dim=0.0,
    yarn_correction_range_round_to_int=True,
)
_PACKING = dict(max_tokens_per_mb=256, block_size=16)


def _gpt(cls, position_embedding_type: str, *, tree_spec: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_tree.mcore.spec import tree_attention_spec

    config = small_gpt_config(add_qkv_bias=True, init_method_std=0.15)
    if position_embedding_type == "yarn":
        for name, value in _YARN.items():
            setattr(config, name, value)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if tree_spec:
        spec = tree_attention_spec(spec, backend="block_sparse", block_size=16)
    torch.manual_seed(0)
    return cls(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=512,
        position_embedding_type=position_embedding_type,
    ).eval()


def _sequences() -> list[torch.Tensor]:
    """A shared prompt with two 48-token branches, and a branch inside the first one (depth 40):
    every branch after the first sits at a packed offset far from its depth."""
    g = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(1, VOCAB, (n,), generator=g)

    prompt = rand(16)
    first = torch.cat([prompt, rand(48)])
    return [first, torch.cat([prompt, rand(48)]), torch.cat([first[:40], rand(20)])]


def _reference_logprobs(model, seqs) -> dict[int, torch.Tensor]:
    out = {}
    with torch.no_grad():
        for i, s in enumerate(seqs):
            logits = model(s[None], torch.arange(len(s))[None], attention_mask=None)
            out[i] = torch.log_softmax(logits[0], -1)[:-1].gather(1, s[1:, None])[:, 0]
    return out


@pytest.mark.parametrize("position_embedding_type", ["rope", "yarn"])
def test_stock_gpt_model_with_the_tree_spec_is_refused(position_embedding_type):
    """A stock GPTModel built with tree_attention_spec attends along the tree but rotates by packed
    offset: its later branches are silently wrong, so the step refuses it, naming TreeGPTModel;
    TreeGPTModel with the same weights matches every sequence run alone."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_tree.mcore.model import TreeGPTModel

    seqs = _sequences()
    reference = _gpt(GPTModel, position_embedding_type, tree_spec=False)
    stock = _gpt(GPTModel, position_embedding_type, tree_spec=True)
    tree = _gpt(TreeGPTModel, position_embedding_type, tree_spec=True)
    stock.load_state_dict(reference.state_dict())
    tree.load_state_dict(reference.state_dict())
    ref = _reference_logprobs(reference, seqs)

    with pytest.raises(ValueError, match=r"\(GPTModel\) rotates by packed offset.*TreeGPTModel"):
        step_logprobs(stock, seqs, **_PACKING)
    with torch.no_grad():
        assert max_err(step_logprobs(tree, seqs, **_PACKING), ref) <= LOGP_TOL

    # What the refusal prevents (the model called directly with the tree mask): the sequence packed
    # first is exact, the later branches are far off.
    wrong = tree_logprobs(stock, seqs)
    errors = sorted(max_err({i: wrong[i]}, {i: ref[i]}) for i in ref)
    assert errors[0] <= LOGP_TOL and errors[-1] > 1e-2, errors


@pytest.mark.parametrize("rope_type", ["rope", "yarn"])
def test_tree_rotary_modules(rope_type):
    """The tree models' rotary modules follow depth and keep Megatron's state dict; outside
    ``at_depths`` they are Megatron's modules; inside, the table is the whole tree's (no
    context-parallel slice) at the given depths, as deep as ``reach``. A stock rotary inside a tree
    MLA layer is refused."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    from harness.models import build_gpt_model, small_mla_config
    from megatron_tree.mcore.model import TreeGPTModel
    from megatron_tree.mcore.rotary import (
        TreeRotaryEmbedding,
        TreeYarnRotaryEmbedding,
        follow_depth,
    )
    from megatron_tree.mcore.spec import check_tree_model

    stock_cls, tree_cls = {
        "rope": (RotaryEmbedding, TreeRotaryEmbedding),
        "yarn": (YarnRotaryEmbedding, TreeYarnRotaryEmbedding),
    }[rope_type]
    gpt_stock = _gpt(GPTModel, rope_type, tree_spec=False)
    gpt_tree = _gpt(TreeGPTModel, rope_type, tree_spec=True)
    assert type(gpt_tree.rotary_pos_emb) is tree_cls
    assert gpt_tree.state_dict().keys() == gpt_stock.state_dict().keys()
    config = small_mla_config(rope_type=rope_type)
    mla_stock = build_gpt_model(config, tree=False, vocab_size=VOCAB)
    mla_tree = build_gpt_model(config, tree=True, vocab_size=VOCAB)
    rotaries = [layer.self_attention.rotary_pos_emb for layer in mla_tree.decoder.layers]
    assert all(type(r) is tree_cls for r in rotaries)
    assert mla_tree.state_dict().keys() == mla_stock.state_dict().keys()

    stock, tree = gpt_stock.rotary_pos_emb, gpt_tree.rotary_pos_emb
    whole = stock(64)
    table = whole[0] if isinstance(whole, tuple) else whole  # YaRN: (table, mscale)
    out = tree(64)
    assert torch.equal(out[0] if isinstance(out, tuple) else out, table)

    class TwoRanks:  # a context-parallel group of 2: a stock call would keep 2 of 4 chunks
        def size(self):
            return 2

        def rank(self):
            return 1

    depths = torch.tensor([[0, 1, 2, 3, 1, 2, 50, 63]])
    with tree.at_depths(depths, reach=64):
        out = tree(8, packed_seq=False, cp_group=TwoRanks())
    if isinstance(out, tuple):
        assert out[1:] == whole[1:]
        out = out[0]
    assert out.shape == (8, 1, 1, table.shape[-1])
    assert torch.equal(out[:, 0], table[depths[0], 0])
    assert follow_depth(tree) is tree
    with pytest.raises(ValueError, match="cannot make Linear follow token depth"):
        follow_depth(torch.nn.Linear(2, 2))

    check_tree_model(mla_tree)
    mla_tree._megatron_tree_checked = False
    rotaries[1].__class__ = stock_cls
    with pytest.raises(
        ValueError,
        match=rf"decoder.layers.1.self_attention \(TreeMLASelfAttention\) rotates by packed "
        rf"offset.*a {stock_cls.__name__}\).*tree_attention_spec",
    ):
        check_tree_model(mla_tree)
