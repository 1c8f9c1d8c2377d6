"""``patch_megatron_bridge_for_tree_training``: NVIDIA Megatron-Bridge builds tree-attention models.

The sibling of :func:`megatron_tree.bridges.mbridge.patch_bridge_for_tree_training`, with the same
contract. Megatron-Bridge (0.6.2) builds a model from a ``GPTModelProvider`` that
``AutoBridge.to_megatron_provider()`` returns (``to_megatron_model()`` goes through it too); the
provider calls its ``transformer_layer_spec`` (a ModuleSpec or a callable) and the module global
``megatron.bridge.models.gpt_provider.MCoreGPTModel`` in ``provide()``. So the patch binds to every
``AutoBridge`` *instance* created inside the block, and makes each provider it returns a tree
provider (:func:`make_tree_provider`):

* its layer spec is rewritten with :func:`megatron_tree.mcore.spec.tree_attention_spec`; without
  transformer-engine, the bridge's default TE specs become Megatron-Bridge's own local spec, and the
  provider's TE-only fusions (rope fusion, persistent layer norm, masked-softmax and
  gradient-accumulation fusion, sequence parallelism) are switched off;
* gated delta-net hybrids (Qwen3-Next, Qwen3.5 dense and MoE): without transformer-engine the
  bridges' TE-only block spec becomes :func:`megatron_tree.mcore.spec.local_hybrid_block_spec`, and
  the TE-only MoE fusions (``moe_permute_fusion``, ``moe_grouped_gemm``) are switched off (the
  experts become a ``SequentialMLP``, whose weights every bridge loads with
  ``megatron_tree.patches.megatron_bridge_experts``, applied then); the
  rewrite makes every ``GatedDeltaNet`` a
  :class:`megatron_tree.mcore.gated_delta_net.TreeGatedDeltaNet`;
* its ``provide()`` builds :class:`megatron_tree.mcore.model.TreeGPTModel` (depth RoPE): the module
  global is swapped while it runs (process-wide for that moment) and restored; the built model is
  checked to have tree attention in every layer (``attention_backend`` is set to ``auto``:
  ``local`` would make Megatron-Bridge overwrite ``core_attention``, ``flash`` / ``fused`` set
  NVTE_* variables that a later model in the process clashes with);
* Mamba hybrids (Nemotron-H, Nemotron 3: a ``HybridModelProvider``): its ``hybrid_stack_spec``
  (the bridge's transformer-engine one by default; without transformer-engine
  :func:`megatron_tree.mcore.hybrid.local_hybrid_stack_spec`) is rewritten the same way (Mamba
  mixers become :class:`megatron_tree.mcore.mamba.TreeMambaMixer`), and ``provide()`` builds
  :class:`megatron_tree.mcore.hybrid.TreeHybridModel` (the module global ``MCoreHybridModel``
  swapped as above). Multi-token prediction is refused at ``provide()``.

No weight-map change is needed: Megatron-Bridge's mapping registry already knows the local spec's
separate norm weights. Megatron-Bridge is imported on first use (the patch block or
:func:`make_tree_provider`). Where transformer-engine is missing, importing this module installs
``megatron_tree.patches.megatron_bridge_te`` (an import hook for the one Megatron-Bridge module
that imports transformer-engine unguarded; a no-op where it is installed), so
``from megatron.bridge import AutoBridge`` works after importing this module, as the docs write it;
nothing else is patched at import. On a CPU-only machine also apply
``megatron_tree.patches.megatron_cpu``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import itertools
from collections.abc import Iterator
from typing import Any

from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import ModuleSpec

from ..core.attention import BACKENDS
from ..mcore.model import TreeGPTModel
from ..mcore.spec import check_tree_model, local_hybrid_block_spec, tree_attention_spec
from ..patches import megatron_bridge_experts, megatron_bridge_nemotron_h, megatron_bridge_te
from ..patches._scoped import swapped
from ._hook import InitHook, cpu_patch_applied
from .load_check import raise_unsourced
from .routing import sigmoid_router_fields

_BOUND_ATTR = "_megatron_tree_tree_training"

# Megatron-Bridge cannot be imported without transformer-engine otherwise: a user who imports this
# module and then ``megatron.bridge`` (docs/usage.md) must not depend on having entered the block.
megatron_bridge_te.apply()


@functools.cache
def _megatron_bridge() -> tuple[Any, type]:
    """Megatron-Bridge's ``gpt_provider`` module and ``AutoBridge``, imported on first use (with
    ``megatron_tree.patches.megatron_bridge_te`` applied where transformer-engine is missing), and
    our modules' tensor-parallel layout registered for its automatic weight mappings (by class
    name): the tree gated delta-net is split like Megatron's (its A_log / dt_bias / conv1d by
    heads), a local norm is replicated, tree core attention's learnable softmax offset (gpt-oss's
    sinks) is split by heads as in DotProductAttention, the local experts' second projection is
    row-parallel."""
    megatron_bridge_te.apply()
    from megatron.bridge.models import gpt_provider
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    for name, kind in (
        ("TreeGatedDeltaNet", "column"),
        ("LocalNorm", "replicated"),
        ("TreeCoreAttention", "column"),
        ("ExpertRowParallelLinear", "row"),
    ):
        AutoMapping.register_module_type(name, kind)
    return gpt_provider, AutoBridge


@functools.cache
def _hybrid_provider() -> Any:
    """Megatron-Bridge's ``hybrid_provider`` module (None where it has none)."""
    _megatron_bridge()
    try:
        from megatron.bridge.models.hybrid import hybrid_provider
    except ImportError:  # pragma: no cover - Megatron-Bridge without HybridModel providers
        return None
    return hybrid_provider


def te_layer_specs() -> set:
    """Megatron-Bridge's transformer-engine layer specs (a provider's default), which fail to build
    without transformer-engine; :func:`make_tree_provider` swaps them for the local spec."""
    gpt_provider, _ = _megatron_bridge()
    return {
        gpt_provider.default_layer_spec,
        gpt_provider.transformer_engine_layer_spec,
        gpt_provider.transformer_engine_full_layer_spec,
    }


# Provider flags that need transformer-engine or apex (finalize() or the torch norms raise).
_TE_ONLY_FLAGS = (
    "apply_rope_fusion",
    "persist_layer_norm",
    "masked_softmax_fusion",
    "gradient_accumulation_fusion",
    "sequence_parallel",
    "moe_permute_fusion",
    "moe_grouped_gemm",
)


def _cpu_sequence_parallel(provider) -> bool:
    """Whether ``provider`` keeps ``sequence_parallel`` without transformer-engine: under the CPU
    patch (:mod:`megatron_tree.patches.megatron_cpu`, whose torch norms take it) at TP > 1, where
    Megatron's ``MoELayer`` refuses MoE training without it."""
    return cpu_patch_applied() and (provider.tensor_model_parallel_size or 1) > 1


def _hybrid_te_spec() -> Any:
    """Megatron-Core's transformer-engine-only block spec of gated delta-net hybrids (0.19+)."""
    try:
        from megatron.core.models.gpt import experimental_attention_variant_module_specs as variants
    except ImportError:
        return None
    return variants.get_transformer_block_with_experimental_attention_variant_spec


def _transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _resolve_spec(spec: Any, config: Any, vp_stage: int | None) -> Any:
    if isinstance(spec, ModuleSpec) or not callable(spec):
        return spec
    if "vp_stage" in inspect.signature(spec).parameters:
        return spec(config, vp_stage=vp_stage)
    return spec(config)


def _hybrid_mtp_depths(provider: Any) -> int:
    """The MTP depths of a hybrid provider's (finalized) layer pattern; 0 for a GPT provider."""
    pattern = getattr(provider, "hybrid_layer_pattern", None)
    if not pattern:
        return 0
    from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern

    return parse_hybrid_pattern(pattern).mtp_num_depths


def _check_tree_model(model: Any, tree_cls: type) -> None:
    if not isinstance(model, tree_cls):
        raise ValueError(f"the provider built {type(model).__name__}, not a {tree_cls.__name__}")
    check_tree_model(model)


def _tree_hybrid_stack_spec(
    provider: Any, hybrid: Any, use_te: bool, backend: str, block_size: int
):
    """The provider's ``hybrid_stack_spec`` as a function of the config that returns it rewritten
    by tree_attention_spec (None: the provider's default; the transformer-engine default without
    transformer-engine: the local hybrid stack spec)."""
    from ..mcore.hybrid import local_hybrid_stack_spec

    base = provider.hybrid_stack_spec
    te_defaults = (
        None,
        hybrid.transformer_engine_hybrid_stack_spec,
        hybrid.default_hybrid_stack_spec,
    )
    if not use_te and any(base is spec for spec in te_defaults):
        base = local_hybrid_stack_spec

    def tree_stack_spec(config):
        if base is None:
            spec = hybrid.get_default_hybrid_stack_spec(config)
        elif isinstance(base, ModuleSpec) or not callable(base):
            spec = base
        elif inspect.signature(base).parameters:
            spec = base(config)
        else:
            spec = base()
        return tree_attention_spec(spec, backend=backend, block_size=block_size)

    return tree_stack_spec


def make_tree_provider(
    provider: Any, *, backend: str = "auto", block_size: int = 128, hf_config: Any = None
) -> Any:
    """Make a Megatron-Bridge ``GPTModelProvider`` or ``HybridModelProvider`` build tree models
    (:class:`~megatron_tree.mcore.model.TreeGPTModel` /
    :class:`~megatron_tree.mcore.hybrid.TreeHybridModel`; in place, idempotent).

    With the checkpoint's ``hf_config`` (what the bound bridges pass), a sigmoid router is checked
    to be one Megatron reproduces (:func:`megatron_tree.bridges.routing.sigmoid_router_fields`).

    Raises:
        ValueError: neither a GPT nor a hybrid provider; at ``provide()``, multi-token prediction
            (``mtp_num_layers``, an MTP part of a hybrid pattern; not a tree operation: set
            ``mtp_num_layers`` to None first).
    """
    if getattr(provider, _BOUND_ATTR, None) is not None:
        return provider
    gpt_provider, _ = _megatron_bridge()
    hybrid = _hybrid_provider()
    is_hybrid = hybrid is not None and isinstance(provider, hybrid.HybridModelProvider)
    if not (is_hybrid or isinstance(provider, gpt_provider.GPTModelProvider)):
        raise ValueError(
            f"{type(provider).__name__} is neither a GPTModelProvider nor a HybridModelProvider; "
            "tree training builds GPT models (attention, MoE and gated delta-net hybrids) and "
            "hybrid models (Mamba hybrids such as Nemotron-H)"
        )
    if (
        hf_config is not None
        and provider.num_moe_experts
        and provider.moe_router_score_function == "sigmoid"
    ):
        for name, value in sigmoid_router_fields(hf_config, where=type(provider).__name__).items():
            setattr(provider, name, value)
    if (
        provider.mtp_num_layers == 0
    ):  # Kimi-K2's provider: 0 means none, but megatron-core 0.16 runs MTP
        provider.mtp_num_layers = None
    if provider.attention_backend != AttnBackend.auto:
        # Tree attention replaces the core attention, so the backend is moot, except that "local"
        # would make Megatron-Bridge overwrite core_attention, and Megatron's LanguageModule
        # asserts that the NVTE_* variables an earlier model set in this process match its
        # backend: HybridModelProvider asks for "flash" where GPT providers use "auto", and
        # building both kinds in one process raised (as mbridge's patch does).
        provider.attention_backend = AttnBackend.auto
    use_te = _transformer_engine_available()
    base_spec = None if is_hybrid else provider.transformer_layer_spec  # hybrid: stack spec below
    if not use_te:
        if base_spec is None:
            pass
        elif base_spec in te_layer_specs():
            base_spec = gpt_provider.local_layer_spec
        elif base_spec is _hybrid_te_spec():
            base_spec = local_hybrid_block_spec
        for flag in _TE_ONLY_FLAGS:
            if flag == "sequence_parallel" and _cpu_sequence_parallel(provider):
                continue
            setattr(provider, flag, False)
        if provider.num_moe_experts:  # SequentialMLP experts: some bridges map only grouped names
            megatron_bridge_experts.apply()

    def tree_layer_spec(config, vp_stage=None):
        return tree_attention_spec(
            _resolve_spec(base_spec, config, vp_stage), backend=backend, block_size=block_size
        )

    original_provide = provider.provide
    if is_hybrid:
        from ..mcore.hybrid import TreeHybridModel

        module, tree_cls, model_global = hybrid, TreeHybridModel, "MCoreHybridModel"
        provider.hybrid_stack_spec = _tree_hybrid_stack_spec(
            provider, hybrid, use_te, backend, block_size
        )
    else:
        module, tree_cls, model_global = gpt_provider, TreeGPTModel, "MCoreGPTModel"
        provider.transformer_layer_spec = tree_layer_spec

    @functools.wraps(original_provide)
    def provide(*args, **kwargs):
        if provider.mtp_num_layers or _hybrid_mtp_depths(provider):
            raise ValueError(
                f"provider.mtp_num_layers={provider.mtp_num_layers}"
                + (f", hybrid_layer_pattern={provider.hybrid_layer_pattern!r}" if is_hybrid else "")
                + ": multi-token prediction is not supported with tree training (a branch point "
                "has one next token per child); set provider.mtp_num_layers = None before "
                "provide()"
                + (
                    " and provider.mtp_hybrid_override_pattern = None before finalize()"
                    if is_hybrid
                    else ""
                )
                + " (RL trains the main head only)"
            )
        with swapped(module, **{model_global: tree_cls}):
            model = original_provide(*args, **kwargs)
        _check_tree_model(model, tree_cls)
        return model

    provider.provide = provide
    setattr(provider, _BOUND_ATTR, {"backend": backend, "block_size": block_size, "use_te": use_te})
    return provider


def _unsourced(model_bridge: Any, hf_pretrained: Any, models: list, keys: set[str]) -> dict:
    """{global parameter name: the HF keys it needs that the checkpoint lacks (None: no mapping)}:
    the parameters and persistent buffers of ``models`` (this rank's) that the bridge's own
    conversion tasks leave without a task (it logs ``Can't find ... in hf_keys`` and skips them);
    ``keys``: the checkpoint's."""
    from megatron.bridge.models.conversion import model_bridge as mb
    from megatron.bridge.models.conversion.utils import persistent_buffers

    models = mb.unwrap_model(models)
    tasks = model_bridge.build_conversion_tasks(hf_pretrained, models)
    covered = {(t.vp_stage, t.param_name) for t in tasks if t is not None and t.megatron_module}
    config = models[0].config
    tied = model_bridge._share_embeddings_and_output_weights(config)
    registry = model_bridge.mapping_registry()
    unsourced = {}
    for vp_stage, model in enumerate(models):
        for local, _ in itertools.chain(model.named_parameters(), persistent_buffers(model)):
            if "_extra_state" in local or model_bridge._is_adapter_param_name(local):
                continue
            local = model_bridge._unwrap_name(local)
            if (vp_stage, local) in covered or (tied and "output_layer" in local):
                continue
            name = mb._megatron_local_name_to_global(models, config, local, vp_stage)
            mapping = registry.megatron_to_hf_lookup(model_bridge._get_lora_unwrapped_name(name))
            if mapping is None:
                unsourced[name] = None
                continue
            hf = mapping.hf_param
            hf = [hf] if isinstance(hf, str) else list(hf.values())
            unsourced[name] = [k for k in hf if k not in keys] or hf
    return unsourced


def _checked_load(load, model_bridge, hf_pretrained, megatron_model, *args, **kwargs):
    """Megatron-Bridge's ``load_weights_hf_to_megatron`` (``load``, the stock function) after two
    steps of ours: Nemotron-H's embedding taken under the name the checkpoint has, and no
    parameter left without a source (:func:`~megatron_tree.bridges.load_check.raise_unsourced`,
    before any weight is read)."""
    keys = set(hf_pretrained.state.source.get_all_keys())
    megatron_bridge_nemotron_h.bind_embedding_key(model_bridge, keys)
    where = getattr(hf_pretrained, "model_name_or_path", None) or "the checkpoint"
    raise_unsourced(
        f"Megatron-Bridge {type(model_bridge).__name__} loading {where}",
        _unsourced(model_bridge, hf_pretrained, megatron_model, keys),
        keys,
    )
    return load(model_bridge, hf_pretrained, megatron_model, *args, **kwargs)


def _bind_load_check(bridge: Any) -> None:
    """Both of the bridge's load paths check first (:func:`_checked_load`): the load hook
    ``to_megatron_provider(load_weights=True)`` registers, and ``load_hf_weights``."""
    from megatron.bridge.models.conversion.model_bridge import MegatronModelBridge

    original = bridge.load_hf_weights
    stock = MegatronModelBridge.load_weights_hf_to_megatron

    @functools.wraps(stock)
    def checked(self, *args, **kwargs):
        return _checked_load(stock, self, *args, **kwargs)

    @functools.wraps(original)
    def load_hf_weights(*args, **kwargs):
        with swapped(MegatronModelBridge, load_weights_hf_to_megatron=checked):
            return original(*args, **kwargs)

    bridge.load_hf_weights = load_hf_weights


def _check_load_hooks(provider: Any) -> None:
    """Replace the weight-loading pre-wrap hook ``to_megatron_provider(load_weights=True)``
    registered (``partial(model_bridge.load_weights_hf_to_megatron, hf_pretrained)``) by
    :func:`_checked_load` on the same model bridge and checkpoint."""
    hooks = getattr(provider, "_pre_wrap_hooks", [])
    for i, hook in enumerate(hooks):
        func = getattr(hook, "func", None)
        if getattr(func, "__name__", None) == "load_weights_hf_to_megatron":
            hooks[i] = functools.partial(
                _checked_load, func.__func__, func.__self__, *hook.args, **hook.keywords
            )


def _bind(bridge: Any, backend: str, block_size: int) -> None:
    if getattr(bridge, _BOUND_ATTR, None) is not None:
        return
    original = bridge.to_megatron_provider

    @functools.wraps(original)
    def to_megatron_provider(*args, **kwargs):
        hf_config = getattr(bridge.hf_pretrained, "config", bridge.hf_pretrained)
        provider = make_tree_provider(
            original(*args, **kwargs), backend=backend, block_size=block_size, hf_config=hf_config
        )
        _check_load_hooks(provider)
        # Nemotron-H: HF's layer_norm_epsilon in every norm (the gated one included)
        return megatron_bridge_nemotron_h.bind(provider, hf_config)

    bridge.to_megatron_provider = to_megatron_provider
    _bind_load_check(bridge)
    setattr(bridge, _BOUND_ATTR, {"backend": backend, "block_size": block_size})


@contextlib.contextmanager
def patch_megatron_bridge_for_tree_training(
    enable: bool = True, *, backend: str = "auto", block_size: int = 128
) -> Iterator[None]:
    """``AutoBridge`` instances created inside this block build tree-attention models with depth
    RoPE.

    Usage::

        with patch_megatron_bridge_for_tree_training():
            bridge = AutoBridge.from_hf_pretrained(hf_path, dtype=torch.float32)
        models = bridge.to_megatron_model(load_weights=True, wrap_with_ddp=False)  # inside or after

    On a machine without transformer-engine, Megatron-Bridge imports only with
    ``megatron_tree.patches.megatron_bridge_te`` applied: importing this module applies it, so
    import ``AutoBridge`` after this module (before it, it fails in that import).

    Args:
        enable: False makes the block a no-op; a disabled block nested in an enabled one creates
            plain bridges. In nested enabled blocks the innermost block's settings apply.
        backend: TreeCoreAttention backend for the models these bridges build.
        block_size: tile size of the flex / block-sparse backends.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    _, auto_bridge = _megatron_bridge()
    with _HOOK.block(
        auto_bridge, {"backend": backend, "block_size": block_size} if enable else None
    ):
        yield


_HOOK = InitHook(bind=lambda bridge, backend, block_size: _bind(bridge, backend, block_size))


def is_tree_training_bridge(bridge: Any) -> bool:
    """True if ``bridge`` was created inside :func:`patch_megatron_bridge_for_tree_training`."""
    return getattr(bridge, _BOUND_ATTR, None) is not None
