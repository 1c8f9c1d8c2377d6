"""DeepSeek-V3 through mbridge 0.15.1: an explicit, reversible, version-gated runtime patch.

Upstream symptoms (``mbridge/models/deepseek_v3.py``, ``DeepseekV3Bridge``; each checked against
HF ``DeepseekV3`` in transformers 4.57 and megatron-core 0.16.1 / 0.17.0):

1. ``AutoBridge.from_pretrained`` raises ``TypeError: MLATransformerConfig.__init__() got an
   unexpected keyword argument 'max_position_embeddings'``: ``_build_config`` passes YaRN's
   pre-training context under the name of an older megatron-core field; megatron-core names it
   ``original_max_position_embeddings``. Its default there is 4096; HF's is
   ``max_position_embeddings``.
2. The RoPE type comes from ``rope_scaling["type"]`` only. HF reads ``rope_type`` (and copies a
   legacy ``type`` into it), so a config naming only ``rope_type: yarn`` (what transformers writes)
   silently gets plain RoPE in Megatron, with YaRN's factor still in the softmax scale.
3. YaRN's mscales: HF scales cos/sin by ``g(mscale) / g(mscale_all_dim)`` only when both are given
   (``g(1)`` otherwise) and the softmax by ``g(mscale_all_dim)^2`` (none without it); mbridge
   fills a missing ``mscale_all_dim`` with 1.0.
4. Group-limited routing is never set: HF picks the best ``topk_group`` of ``n_group`` expert
   groups first (DeepSeek-V3: 4 of 8) and routes inside them; without ``moe_router_num_groups`` /
   ``moe_router_group_topk`` Megatron routes over all experts, so tokens reach other experts.
5. ``mtp_num_layers = num_nextn_predict_layers`` is 0, not None, for a checkpoint without MTP
   layers; megatron-core tests ``is not None`` (0.16.1's ``GPTModel.forward`` then runs its MTP
   loss branch).
6. ``load_weights`` fails for every dtype but bf16 (``_get_safetensor_io``: ``TypeError:
   'NotImplementedType' object is not callable``), and for bf16 always reads through the FP8
   dequantizer, which imports triton and opens the files on CUDA, also for unquantized checkpoints.

The patch corrects the keyword arguments ``_build_config`` hands to ``_build_base_config`` (from the
HF config, as HF's model reads it; settings Megatron cannot express raise ``ValueError``) and reads
unquantized checkpoints (no ``quantization_config``) with mbridge's plain ``SafeTensorIO``. Two
forms: :func:`bind` corrects one bridge instance before its ``Bridge.__init__`` runs (what
``patch_bridge_for_tree_training`` does for every DeepSeek-V3 bridge it creates; the instance keeps
it, so later ``set_extra_args`` rebuilds stay correct); :func:`apply` / :func:`undo` (and
:func:`mbridge_deepseek_patch`) patch the class process-wide, for plain bridges. Verified on mbridge
``TARGET_MBRIDGE``; another series warns, missing symbols raise ``RuntimeError`` before any change.
"""

from __future__ import annotations

import functools
import importlib.metadata
import warnings
from typing import Any

from ._scoped import scoped

TARGET_MBRIDGE = "0.15"
_ABSENT = object()
_saved: list[tuple[str, Any]] = []  # (attribute of DeepseekV3Bridge, original or _ABSENT)


def _bridge_class() -> type:
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge

    return DeepseekV3Bridge


def _check() -> type:
    """The bridge class; RuntimeError if a symbol this patch wraps is missing, a warning
    off-target."""
    version = importlib.metadata.version("mbridge")
    try:
        cls = _bridge_class()
        missing = [
            n
            for n in ("_build_config", "_build_base_config", "_get_safetensor_io")
            if not hasattr(cls, n)
        ]
    except ImportError:
        missing = ["mbridge.models.deepseek_v3.DeepseekV3Bridge"]
    if missing:
        raise RuntimeError(
            f"megatron_tree.patches.mbridge_deepseek targets mbridge {TARGET_MBRIDGE}.x; the "
            f"installed mbridge {version} lacks {', '.join(missing)}: check DeepseekV3Bridge and "
            "update the patch"
        )
    if ".".join(version.split(".")[:2]) != TARGET_MBRIDGE:
        warnings.warn(
            f"mbridge_deepseek patch is verified on mbridge {TARGET_MBRIDGE}.x, found {version}",
            stacklevel=3,
        )
    return cls


def applies_to(bridge: Any) -> bool:
    """True for instances of mbridge's DeepSeek-V3 bridge (and its subclasses)."""
    try:
        return isinstance(bridge, _bridge_class())
    except ImportError:
        return False


def group_routing(hf_config) -> dict:
    """Megatron's group-limited routing for HF's ``n_group`` / ``topk_group`` (symptom 4)."""
    from ..bridges.routing import sigmoid_router_fields

    return sigmoid_router_fields(hf_config, where="DeepseekV3Bridge")


def _rope_kwargs(hf_config) -> dict:
    """MLA rotary settings as HF's DeepseekV3 model reads ``rope_scaling`` (symptoms 1-3)."""
    rope = dict(getattr(hf_config, "rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise ValueError(
            f"rope_scaling type {rope_type!r}: Megatron's multi-latent attention has 'rope' and "
            "'yarn' only"
        )
    if rope_type == "default":
        return {
            "rope_type": "rope",
            "rotary_scaling_factor": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.0,
        }
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if (
        "attention_factor" in rope
        or not rope.get("truncate", True)
        or (mscale_all_dim and not mscale)
    ):
        raise ValueError(
            f"rope_scaling {rope}: Megatron's YaRN takes its cos/sin scale from mscale / "
            "mscale_all_dim and truncates the correction range; an explicit attention_factor, "
            "truncate=False or mscale_all_dim without mscale cannot be reproduced"
        )
    if not (mscale and mscale_all_dim):  # HF: cos/sin scaled by g(1), softmax unscaled
        mscale, mscale_all_dim = 1.0, 0.0
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": rope["factor"],
        "original_max_position_embeddings": rope.get("original_max_position_embeddings")
        or hf_config.max_position_embeddings,
        "beta_fast": rope.get("beta_fast") or 32,
        "beta_slow": rope.get("beta_slow") or 1,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }


def fixed_config_kwargs(hf_config, kwargs: dict) -> dict:
    """``DeepseekV3Bridge._build_config``'s keyword arguments, corrected (idempotent)."""
    kwargs = dict(kwargs)
    kwargs.pop("max_position_embeddings", None)
    kwargs.update(_rope_kwargs(hf_config))
    kwargs.update(group_routing(hf_config))
    if kwargs.get("mtp_num_layers") == 0:
        kwargs["mtp_num_layers"] = None
        kwargs.pop("mtp_loss_scaling_factor", None)
    return kwargs


def _build_with(self, build, text_config_key=None, **kwargs):
    """``build`` (the class's ``_build_base_config``) with symptoms 1-5 corrected."""
    return build(self, text_config_key, **fixed_config_kwargs(self.hf_config, kwargs))


def _io_with(self, read, weights_path):
    """Symptom 6: only FP8 checkpoints need the dequantizing reader ``read`` (CUDA and triton)."""
    if getattr(self.hf_config, "quantization_config", None) is None:
        from mbridge.core.bridge import Bridge

        return Bridge._get_safetensor_io(self, weights_path)  # plain SafeTensorIO
    return read(self, weights_path)


def bind(bridge: Any) -> None:
    """Correct this bridge instance; call it before ``Bridge.__init__`` builds its config."""
    cls = _check()
    if not isinstance(bridge, cls):
        raise TypeError(f"{type(bridge).__name__} is not a DeepseekV3Bridge")
    build, read = type(bridge)._build_base_config, type(bridge)._get_safetensor_io
    bridge._build_base_config = functools.partial(_build_with, bridge, build)
    bridge._get_safetensor_io = functools.partial(_io_with, bridge, read)


def apply() -> bool:
    """Patch ``DeepseekV3Bridge`` process-wide (idempotent); returns True."""
    if _saved:
        return True
    cls = _check()
    for name in ("_build_base_config", "_get_safetensor_io"):
        _saved.append((name, vars(cls).get(name, _ABSENT)))
    build, read = cls._build_base_config, cls._get_safetensor_io
    cls._build_base_config = functools.partialmethod(_build_with, build)
    cls._get_safetensor_io = functools.partialmethod(_io_with, read)
    return True


def undo() -> None:
    """Put back exactly what :func:`apply` replaced (idempotent); bound instances keep their fix."""
    while _saved:
        name, original = _saved.pop()
        if original is _ABSENT:
            delattr(_bridge_class(), name)
        else:
            setattr(_bridge_class(), name, original)


def is_applied() -> bool:
    """True while :func:`apply` is in effect."""
    return bool(_saved)


def mbridge_deepseek_patch():
    """:func:`apply` for the duration of the block (only the block that applied it undoes it)."""
    return scoped(apply, undo, is_applied)
