"""Load experts into Megatron's ``SequentialMLP`` through every Megatron-Bridge bridge: an explicit,
reversible, version-gated patch.

Upstream symptom (megatron-bridge 0.6.2, ``TARGET_MEGATRON_BRIDGE``): without transformer-engine an
MoE model's experts are a ``SequentialMLP`` (``moe_grouped_gemm`` needs TE), whose parameters are
named ``...mlp.experts.local_experts.E.linear_fc1.weight``. Some bridges map only the grouped
names (``...mlp.experts.linear_fc1.weightE``): GLM-4.5's (``GLM45Bridge``) does, so loading a
GLM-4.5 checkpoint warns "No mapping found for megatron_param ... local_experts.0.linear_fc1.weight"
for every expert and then fails (``AttributeError: 'NoneType' object has no attribute
'megatron_module'``). Qwen3-MoE's and DeepSeek-V3's bridges map both names.

The patch adds to every ``MegatronMappingRegistry`` built, for each grouped expert mapping
(``...experts.linear_fcK.weight*``) without a ``local_experts`` twin, the twin
``...experts.local_experts.*.linear_fcK.weight``: the same mapping class and HF weights, resolved by
the mapping's own ``resolve`` with the same captures (layer, expert). Mappings the bridge defines
are kept as they are, so a bridge that maps both names is unchanged.
"""

from __future__ import annotations

import copy
import re

from ._scoped import scoped

TARGET_MEGATRON_BRIDGE = "0.6.2"
# ...experts.linear_fc<k>.<weight|bias>*  ->  ...experts.local_experts.*.linear_fc<k>.<weight|bias>
_GROUPED = re.compile(r"^(?P<head>.*\.experts)\.(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)\*$")
_original = None


def _registry():
    from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry

    return MegatronMappingRegistry


def _local_twins(mappings) -> list:
    names = {m.megatron_param for m in mappings}
    twins = []
    for mapping in mappings:
        match = _GROUPED.match(mapping.megatron_param)
        if match is None:
            continue
        local = f"{match['head']}.local_experts.*.{match['fc']}.{match['kind']}"
        if local not in names:
            twin = copy.copy(mapping)  # resolve() builds a fresh mapping from these two names
            twin.megatron_param = local
            twins.append(twin)
            names.add(local)
    return twins


def _init(self, *mappings, **kwargs):
    _original(self, *mappings, *_local_twins(mappings), **kwargs)


def is_applied() -> bool:
    return _original is not None


def apply() -> bool:
    """Install the twins (idempotent); returns True."""
    global _original
    if _original is None:
        import megatron.bridge

        version = getattr(megatron.bridge, "__version__", "unknown")
        if not version.startswith(TARGET_MEGATRON_BRIDGE.rsplit(".", 1)[0]):
            raise RuntimeError(
                "megatron_tree.patches.megatron_bridge_experts targets megatron-bridge "
                f"{TARGET_MEGATRON_BRIDGE}, found {version}; check its expert mappings and update "
                "the patch"
            )
        registry = _registry()
        _original = registry.__init__
        registry.__init__ = _init
    return True


def undo() -> None:
    """Restore the original constructor (idempotent); registries built meanwhile keep their
    twins."""
    global _original
    if _original is not None:
        _registry().__init__ = _original
        _original = None


def megatron_bridge_experts_patch():
    """Context manager form of :func:`apply` / :func:`undo`."""
    return scoped(apply, undo, is_applied)
