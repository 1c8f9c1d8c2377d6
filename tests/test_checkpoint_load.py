"""Every Megatron parameter gets a source from the checkpoint, or the load raises (issue 42
items 1-2).

A checkpoint with one key renamed (as a fine-tune or a transformers version can write it): under
our bridge patches the load raises :class:`UnsourcedParametersError` naming the Megatron parameter,
the key it needs and the checkpoint's near match, before any weight is read. Without the check
mbridge raises naming the HF key only, and Megatron-Bridge logs a warning and leaves the parameter
as allocated. Nemotron-H and its MoE variant written by transformers 5's own
``save_pretrained`` (embedding ``backbone.embedding.weight``) load completely and give HF's
log-probs (the parity itself: tests/test_nemotron_h.py, whose checkpoints are written the same
way).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from harness.marks import CPU_SUITE, MEGATRON_BRIDGE_STACK
from harness.models import NEMOTRON_H_MOE, make_hf_checkpoint, rename_weights

pytestmark = CPU_SUITE
NEEDS_MEGATRON_BRIDGE = MEGATRON_BRIDGE_STACK[0]  # (its other mark is CPU_SUITE)
RENAMED = {"model.layers.1.mlp.down_proj.weight": "model.layers.1.mlp.down_proj.weights"}


def _assert_names_the_renamed_key(error: Exception, parameter: str) -> None:
    message = str(error)
    assert parameter in message, message
    old, new = next(iter(RENAMED.items()))
    assert f"<- {old}: not in the checkpoint; the checkpoint's nearest: {new}" in message, message
    assert "1 Megatron parameter(s)" in message, message


def _mbridge_stack() -> str | None:
    """Why mbridge does not run here (None: it does): it needs transformers < 5."""
    if importlib.util.find_spec("mbridge") is None:
        return "mbridge is not installed"
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        return f"mbridge does not run with transformers {transformers.__version__} (this stack's)"
    return None


@pytest.mark.skipif(_mbridge_stack() is not None, reason=str(_mbridge_stack()))
def test_mbridge_load_with_a_renamed_key_raises_naming_it(world, tmp_path):
    from mbridge import AutoBridge

    from megatron_tree.bridges.load_check import UnsourcedParametersError
    from megatron_tree.bridges.mbridge import patch_bridge_for_tree_training

    path = str(tmp_path / "qwen3")
    make_hf_checkpoint("qwen3", path)
    with patch_bridge_for_tree_training():
        bridge = AutoBridge.from_pretrained(path, dtype=torch.float32)
    bridge.get_model(weight_path=path, bf16=False, wrap_with_ddp=False)  # the intact file loads
    rename_weights(path, RENAMED)
    with pytest.raises(UnsourcedParametersError) as error:
        bridge.get_model(weight_path=path, bf16=False, wrap_with_ddp=False)
    _assert_names_the_renamed_key(error.value, "decoder.layers.1.mlp.linear_fc2.weight")


def _megatron_bridge_model(path: str, *, tree: bool):
    from megatron_tree.bridges.megatron_bridge import patch_megatron_bridge_for_tree_training
    from megatron_tree.patches import megatron_bridge_te

    megatron_bridge_te.apply()
    from megatron.bridge import AutoBridge

    with patch_megatron_bridge_for_tree_training(enable=tree):
        bridge = AutoBridge.from_hf_pretrained(path, dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.finalize()
    return bridge, provider.provide_distributed_model(wrap_with_ddp=False, bf16=False)


@pytest.mark.parametrize("load", ["to_megatron_provider", "load_hf_weights"])
@NEEDS_MEGATRON_BRIDGE
def test_megatron_bridge_load_with_a_renamed_key_raises_naming_it(world, tmp_path, load):
    """Both load paths: the provider's load hook and ``load_hf_weights`` (verl's and AReaL's)."""
    from megatron_tree.bridges.load_check import UnsourcedParametersError

    path = str(tmp_path / "qwen3")
    make_hf_checkpoint("qwen3", path)
    bridge, models = _megatron_bridge_model(path, tree=True)
    rename_weights(path, RENAMED)
    with pytest.raises(UnsourcedParametersError) as error:
        if load == "load_hf_weights":
            bridge.load_hf_weights(models, path)
        else:
            _megatron_bridge_model(path, tree=True)
    _assert_names_the_renamed_key(error.value, "decoder.layers.1.mlp.linear_fc2.weight")


@NEEDS_MEGATRON_BRIDGE
def test_stock_megatron_bridge_load_leaves_the_parameter_unloaded(world, tmp_path):
    """The defect the check closes, with Megatron-Bridge's own load (its model bridge, not ours)
    into the model built from the intact file: no error, the renamed key's parameter keeps what
    it held (zeros here), the others are loaded."""
    from megatron.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM
    from safetensors.torch import load_file

    path = str(tmp_path / "qwen3")
    make_hf_checkpoint("qwen3", path)
    bridge, models = _megatron_bridge_model(path, tree=True)
    rename_weights(path, RENAMED)
    params = dict(models[0].named_parameters())
    with torch.no_grad():
        for name in (
            "decoder.layers.0.mlp.linear_fc2.weight",
            "decoder.layers.1.mlp.linear_fc2.weight",
        ):
            params[name].zero_()
    bridge._model_bridge.load_weights_hf_to_megatron(
        PreTrainedCausalLM.from_pretrained(path), models
    )
    saved = load_file(f"{path}/model.safetensors")
    assert torch.equal(
        params["decoder.layers.0.mlp.linear_fc2.weight"].detach(),
        saved["model.layers.0.mlp.down_proj.weight"],
    )
    assert not params["decoder.layers.1.mlp.linear_fc2.weight"].detach().any()


@pytest.mark.parametrize("overrides", [{}, NEMOTRON_H_MOE], ids=["nemotron_h", "nemotron_h_moe"])
@NEEDS_MEGATRON_BRIDGE
def test_nemotron_h_saved_by_transformers_loads_every_parameter(world, tmp_path, overrides):
    """transformers 5's save_pretrained names the embedding ``backbone.embedding.weight``: the
    tree bridge loads it into Megatron's embedding (equal to the file's tensor), and every other
    parameter has a source (the load check passes)."""
    from safetensors.torch import load_file

    from megatron_tree.patches.megatron_bridge_nemotron_h import SAVED_EMBEDDING

    path = str(tmp_path / "nemotron_h")
    make_hf_checkpoint("nemotron_h", path, **overrides)
    saved = load_file(f"{path}/model.safetensors")
    assert SAVED_EMBEDDING in saved  # as transformers writes it
    _, models = _megatron_bridge_model(path, tree=True)
    embedding = dict(models[0].named_parameters())["embedding.word_embeddings.weight"]
    torch.testing.assert_close(embedding.detach(), saved[SAVED_EMBEDDING], rtol=0, atol=0)
