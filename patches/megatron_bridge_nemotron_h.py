"""Nemotron-H through Megatron-Bridge with HF's norm epsilon: an explicit, version-gated patch.

Upstream symptom (megatron-bridge 0.6.2, ``TARGET_MEGATRON_BRIDGE``; transformers 5.12): HF's
Nemotron-H normalizes with ``layer_norm_epsilon`` everywhere (every block's RMSNorm, the final
norm, and the Mamba mixer's gated norm), and reads no other epsilon. The bridge instead

1. takes Megatron's ``layernorm_epsilon`` from ``rms_norm_eps`` when the config carries one (the
   base bridge's mapping comes first and the first mapped value wins; HF keeps such a stray key as
   an unused attribute), so a config with ``rms_norm_eps=1e-6`` and the default
   ``layer_norm_epsilon=1e-5`` gets 1e-6 in Megatron's norms and 1e-5 in HF's: log-probs 6e-4 ..
   1.6e-3 off HF on a tiny checkpoint (hidden 64, 8 Mamba heads of 16);
2. leaves the gated norm at the 1e-5 that megatron-core's ``MambaMixer`` hard-codes
   (``ExtendedRMSNorm(..., eps=1e-5)``), so ``layer_norm_epsilon=1e-6`` alone is 3.7e-2 off.

``bind(provider, hf_config)`` corrects one Nemotron-H provider: ``layernorm_epsilon`` becomes
``layer_norm_epsilon``, and every Mamba mixer of the models it provides gets its gated norm's
``eps`` set to it (after the build: the norm's epsilon is not a config field). A config whose
Mamba layers Megatron computes differently is refused instead (``check_config``).
``bind_embedding_key(model_bridge, hf_keys)`` takes the embedding from the name transformers 5
writes: its ``save_pretrained`` names it ``backbone.embedding.weight`` (HF reads that and NVIDIA's
``backbone.embeddings.weight``), the bridge maps only the latter and, without it, logged a warning
and left Megatron's embedding as allocated (NaN log-probs).
``patch_megatron_bridge_for_tree_training`` binds every Nemotron-H provider and load of its
bridges;
``apply()`` / ``undo()`` (or ``nemotron_h_epsilon_patch()``) wrap
``NemotronHBridge.provider_bridge`` for plain bridges. Other model types pass through untouched.

Not changed, by design: HF's CPU scan (``torch_forward``) clamps dt from below at
``time_step_min`` (default 1e-3); its CUDA path, mamba_ssm's kernels (``dt_limit=time_step_limit``,
(0, inf) by default) and Megatron do not. The tree model follows the kernels, which rollout
engines run.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from ._scoped import scoped

TARGET_MEGATRON_BRIDGE = "0.6.2"
_BOUND_ATTR = "_megatron_tree_nemotron_h_eps"
_original = None


def _check_version() -> None:
    import megatron.bridge

    version = getattr(megatron.bridge, "__version__", "unknown")
    if not version.startswith(TARGET_MEGATRON_BRIDGE.rsplit(".", 1)[0]):
        raise RuntimeError(
            "megatron_tree.patches.megatron_bridge_nemotron_h targets megatron-bridge "
            f"{TARGET_MEGATRON_BRIDGE}, found {version}; check how its Nemotron-H bridge maps "
            "layer_norm_epsilon and update the patch"
        )


def check_config(hf_config: Any) -> None:
    """Refuse a Nemotron-H config whose Mamba or MLP layers Megatron computes differently from HF.

    Raises:
        ValueError: ``time_step_limit`` other than (0, inf) (Megatron's mixer never clamps dt),
            ``mamba_hidden_act`` other than silu (its convolution activation), ``mlp_hidden_act``
            other than relu2 (the bridge sets squared ReLU).
    """
    limit = tuple(float(v) for v in getattr(hf_config, "time_step_limit", None) or (0.0, math.inf))
    if limit != (0.0, math.inf):
        raise ValueError(
            f"Nemotron-H time_step_limit={limit}: Megatron's Mamba mixer does not clamp dt "
            "(HF's CUDA scan clamps it to time_step_limit); set time_step_limit=(0.0, inf) in the "
            "checkpoint's config.json, or keep this model on HF"
        )
    for field, value in (("mamba_hidden_act", "silu"), ("mlp_hidden_act", "relu2")):
        got = getattr(hf_config, field, value)
        if got != value:
            raise ValueError(
                f"Nemotron-H {field}={got!r}: Megatron-Bridge builds {value!r} there; convert only "
                f"checkpoints with {field}={value!r}"
            )


def set_gated_norm_eps(model: Any, eps: float) -> int:
    """Set the gated norm's ``eps`` of every Megatron Mamba mixer in ``model``; returns how many."""
    from megatron.core.ssm.mamba_mixer import MambaMixer

    mixers = [m for m in model.modules() if isinstance(m, MambaMixer)]
    for mixer in mixers:
        mixer.norm.eps = eps
    return len(mixers)


def bind(provider: Any, hf_config: Any) -> Any:
    """Correct ``provider`` (built from the Nemotron-H ``hf_config``) in place and return it; any
    other model type is returned as it is. Idempotent.

    Raises:
        ValueError: see :func:`check_config`.
    """
    if getattr(hf_config, "model_type", None) != "nemotron_h":
        return provider
    if getattr(provider, _BOUND_ATTR, None) is not None:
        return provider
    _check_version()
    check_config(hf_config)
    eps = float(hf_config.layer_norm_epsilon)
    provider.layernorm_epsilon = eps
    original_provide = provider.provide

    @functools.wraps(original_provide)
    def provide(*args, **kwargs):
        model = original_provide(*args, **kwargs)
        set_gated_norm_eps(model, eps)
        return model

    provider.provide = provide
    setattr(provider, _BOUND_ATTR, eps)
    return provider


EMBEDDING = "backbone.embeddings.weight"  # NVIDIA's checkpoints; Megatron-Bridge's map
SAVED_EMBEDDING = "backbone.embedding.weight"  # transformers 5's save_pretrained
_EMBEDDING_ATTR = "_megatron_tree_embedding_key"


def bind_embedding_key(model_bridge: Any, hf_keys: set[str]) -> None:
    """Make a Nemotron-H model bridge read the embedding from ``backbone.embedding.weight`` when
    the checkpoint (its keys ``hf_keys``) has that name and not the mapped one; any other bridge
    or checkpoint is left as it is. Idempotent."""
    if not isinstance(model_bridge, _nemotron_h_bridge()) or getattr(
        model_bridge, _EMBEDDING_ATTR, False
    ):
        return
    if EMBEDDING in hf_keys or SAVED_EMBEDDING not in hf_keys:
        return
    _check_version()
    original = model_bridge.mapping_registry

    @functools.wraps(original)
    def mapping_registry():
        registry = original()
        for mapping in registry.mappings:
            if mapping.hf_param == EMBEDDING:
                mapping.hf_param = SAVED_EMBEDDING
        return registry

    model_bridge.mapping_registry = mapping_registry
    setattr(model_bridge, _EMBEDDING_ATTR, True)


def _nemotron_h_bridge() -> type:
    from megatron.bridge.models.nemotronh.nemotron_h_bridge import NemotronHBridge

    return NemotronHBridge


def is_applied() -> bool:
    return _original is not None


def apply() -> bool:
    """Make every ``NemotronHBridge.provider_bridge`` return a :func:`bind`-corrected provider
    (idempotent); returns True."""
    global _original
    if _original is None:
        _check_version()
        bridge_cls = _nemotron_h_bridge()
        original = bridge_cls.provider_bridge

        @functools.wraps(original)
        def provider_bridge(self, hf_pretrained):
            return bind(original(self, hf_pretrained), hf_pretrained.config)

        _original = original
        bridge_cls.provider_bridge = provider_bridge
    return True


def undo() -> None:
    """Restore ``NemotronHBridge.provider_bridge`` (providers already bound stay corrected)."""
    global _original
    if _original is not None:
        _nemotron_h_bridge().provider_bridge = _original
        _original = None


def nemotron_h_epsilon_patch():
    """``apply()`` for the block, ``undo()`` after (nesting is safe)."""
    return scoped(apply, undo, is_applied)
