"""AReaL 1.0.4's Megatron engine on a CPU-only machine, for tests: the stand-ins and patches.

Everything CPU-specific of the AReaL fixture lives here, never in the library. Each patch below is
one need, found by removing it and reading the failure; all of them act around AReaL (its imports,
its device handling, Megatron and mbridge), none inside its tree code. They are process-wide and
not undone: call :func:`setup_cpu` in a spawned worker (``harness.dist``). The
Megatron / mbridge pieces are those of the verl fixture (:mod:`harness.verl`, which
imports verl only inside its functions).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from types import ModuleType

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_tree.patches._scoped import swapped

from .dist import installed
from .verl import (
    _CUDA_FACTORY_MODULES,
    _TorchOnCpu,
    apply_mbridge_compat,
    apply_megatron_cpu_patch,
    cpu_grad_clipping,
    import_megatron_bridge_without_te,
    mbridge_local_layer_spec,
)

# Modules AReaL 1.0.4 imports at module level on the way to its Megatron engine, its PPO actor and
# PPOTrainer, but never calls on this path (experiment loggers, dataset loading, the SGLang
# client's base64, the Ray name-resolve backend, Megatron-Bridge, the FP8 Triton kernels); large or
# GPU-only, so they are stood in for instead of installed. A stand-in is used only where the real
# module is absent.
STAND_IN_MODULES = (
    "datasets",  # areal/utils/dataloader.py
    "wandb",  # areal/utils/stats_logger.py
    "swanlab",  # areal/utils/stats_logger.py
    "trackio",  # areal/utils/stats_logger.py
    "ray",  # areal/utils/name_resolve.py (``@ray.remote`` on a class at import)
    "numba",  # areal/utils/seqpack.py (``@numba.njit`` on one packing helper)
    "megatron.bridge",  # areal/engine/megatron_engine.py (bridge_type="megatron-bridge" only)
    "areal.engine.megatron_utils.fp8.kernels",  # imports triton; FP8 training only
    # imports triton; Archon's MoE token permutation (its CPU variant is never selected)
    "areal.experimental.models.archon.moe.kernels",
)


class _UnavailableMeta(type):
    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"{cls.__qualname__} is a test stand-in (testing.areal_platform)")

    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _unavailable(f"{cls.__qualname__}.{name}")


def _unavailable(name: str) -> type:
    """What a stand-in module gives for any name: a class (usable in annotations, ``X | None``,
    ``isinstance`` and as a base) that fails loudly when called, its attributes alike."""
    cls = _UnavailableMeta(name.rpartition(".")[2], (), {})
    cls.__qualname__ = name
    return cls


def _identity_decorator(*args, **kwargs):
    """``@njit`` / ``@ray.remote`` with or without arguments: the decorated object unchanged
    (numba's njit compiles the same Python semantics; the Ray actor class is never instantiated
    here)."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return lambda obj: obj


class _StandIn(ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _unavailable(f"{self.__name__}.{name}")


def _stand_in(name: str) -> ModuleType:
    module = _StandIn(name)
    module.__spec__ = ModuleSpec(name, None)  # importlib.util.find_spec() reads it
    module.__path__ = []  # a package: submodules can be stood in too
    module.__file__ = None
    if name == "numba":
        module.njit = module.jit = _identity_decorator
    if name == "ray":
        module.remote = _identity_decorator
        module.is_initialized = lambda: False
    return module


def _absent(name: str) -> bool:
    if name in sys.modules:
        return False
    try:
        return importlib.util.find_spec(name) is None
    except (ModuleNotFoundError, ValueError):  # a parent package is missing or stood in
        return True


# AReaL modules imported while the stand-ins are in sys.modules, in an order free of AReaL's import
# cycles (areal.api.cli_args first is one): the package, the engine, its PPO actor (imported by
# MegatronPPOActor.__init__) and the trainer whose _create_train_engine the builder calls.
_AREAL_MODULES = (
    "areal",
    "areal.engine.megatron_engine",
    "areal.trainer.ppo.actor",
    "areal.trainer.rl_trainer",
    "areal.experimental.engine.archon_engine",
)


class _StandInFinder:
    """Finds every submodule of a stood-in package (``ray.util.placement_group``, ...) as a stand-in
    too."""

    def __init__(self, roots: list[str]):
        self.roots = roots

    def find_spec(self, name, path=None, target=None):
        if any(name.startswith(root + ".") for root in self.roots):
            return ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return _stand_in(spec.name)

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def stand_in_modules() -> Iterator[list[str]]:
    """The absent :data:`STAND_IN_MODULES` (and any submodule of theirs) importable as stand-ins
    for the block (yields the names stood in for), removed from ``sys.modules`` after it: AReaL's
    modules keep the references they imported, nothing else sees them.
    ``areal.engine.megatron_utils.fp8.kernels`` and Archon's MoE ``kernels`` exist but import
    triton, so they are stood in while triton is absent."""
    roots = [
        n
        for n in STAND_IN_MODULES
        if n not in sys.modules
        # the fp8 kernels' module is looked at through triton alone: find_spec on it would import
        # AReaL before its stand-ins are in place, and a failed package import leaves submodules
        # in sys.modules that the later import never binds to the package (areal.engine)
        and (_absent("triton") if n.endswith(".kernels") else _absent(n))
    ]
    for name in roots:
        sys.modules[name] = _stand_in(name)
    finder = _StandInFinder(roots)
    sys.meta_path.insert(0, finder)
    try:
        yield roots
    finally:
        sys.meta_path.remove(finder)
        for name in list(sys.modules):
            if any(name == root or name.startswith(root + ".") for root in roots):
                del sys.modules[name]


def import_areal() -> None:
    """Import AReaL's engine, actor and trainer modules inside :func:`stand_in_modules`."""
    with stand_in_modules():
        for name in _AREAL_MODULES:
            importlib.import_module(name)


def cpu_local_rank_device() -> None:
    """``MegatronEngine.initialize`` sets ``self.device = torch.device(int(LOCAL_RANK))`` (CUDA
    device 0) and builds and loads the model under ``with self.device:``; on a CPU every tensor
    made there fails ("Found no NVIDIA driver"). The engine module's ``torch`` is given a
    ``device`` that maps device indices and "cuda" to the CPU; everything else is torch itself."""
    from areal.engine import megatron_engine

    megatron_engine.torch = _TorchWithCpuDevices()


class _TorchWithCpuDevices:
    @staticmethod
    def device(*args, **kwargs):
        if args and (isinstance(args[0], int) or str(args[0]).startswith("cuda")):
            return torch.device("cpu")
        return torch.device(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch, name)


def tokenizer_optional() -> None:
    """``initialize`` loads the checkpoint's tokenizer (``load_hf_tokenizer``), used only to save
    HF checkpoints; the tiny test checkpoints have none (OSError). Without tokenizer files the
    engine gets None."""
    from areal.engine import megatron_engine

    original = megatron_engine.load_hf_tokenizer

    def load_hf_tokenizer(path, *args, **kwargs):
        if not any(
            os.path.exists(os.path.join(path, f))
            for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        ):
            return None
        return original(path, *args, **kwargs)

    megatron_engine.load_hf_tokenizer = load_hf_tokenizer


class _NoCheckpointer:
    """AReaL's MegatronCheckpointManager in tests that never save or load a checkpoint."""

    def __init__(self, **kwargs):
        pass

    def close(self):  # MegatronEngine.destroy drains pending saves: there are none
        pass

    def __getattr__(self, name: str):
        raise RuntimeError("checkpointing is stood in for (testing.areal_platform.no_checkpointer)")


def no_checkpointer() -> None:
    """Megatron's DistributedOptimizer accepts only torch.cuda tensor types, so the test engines use
    the plain optimizer (``megatron.ddp.use_distributed_optimizer=False``, set by the builder), and
    AReaL's ``MegatronCheckpointManager`` (made in ``_create_optimizer``) asserts the distributed
    one. The tests save no checkpoints: a stand-in that fails if used."""
    from areal.engine import megatron_engine

    megatron_engine.MegatronCheckpointManager = _NoCheckpointer


def redirect_cuda_in_optimizer_and_ddp() -> None:
    """The verl fixture's redirect (``testing.verl.redirect_cuda_in_optimizer_and_ddp``: Megatron's
    optimizer, grad clipping, DDP buffers and l2 norm make small ``device="cuda"`` tensors and read
    CUDA streams), for the modules of that list installed here (``megatron.training`` comes with
    Megatron-Bridge only)."""
    for name in _CUDA_FACTORY_MODULES:
        if installed(name):
            importlib.import_module(name).torch = _TorchOnCpu()


class PackedDotProductAttention(DotProductAttention):
    """Megatron's local ``DotProductAttention`` taking THD-packed sequences: ``cu_seqlens_q``
    (``_padded``) become the same causal block-diagonal mask ([1, 1, T, T], True = masked) over
    the [T, 1, H, D] tokens. The fused masked softmax is off: it is a CUDA extension
    (``scaled_masked_softmax_cuda``) that bf16 inputs would select.

    Multi-latent attention passes ``k_channels`` / ``v_channels`` (query-key and value head dims
    differ), which only transformer-engine's attention takes; with them the packed attention is
    written out (scores at MLA's ``softmax_scale``, the mask above, fp32 softmax, weighted
    values)."""

    def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale_mask_softmax.scaled_masked_softmax_fusion = False
        self.explicit = v_channels is not None
        self.explicit_scale = kwargs.get("softmax_scale")

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias
            )
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        n = query.shape[0]  # [T, H, D]: attention.py squeezes the batch of 1 for THD
        segment = torch.repeat_interleave(
            torch.arange(len(cu) - 1, device=query.device), (cu[1:] - cu[:-1]).long()
        )
        assert segment.numel() == n, (segment.numel(), n)
        future = torch.ones(n, n, dtype=torch.bool, device=query.device).triu(1)
        masked = (segment[:, None] != segment[None, :]) | future
        if self.explicit:
            return _explicit_attention(query, key, value, masked, self.explicit_scale)
        return super().forward(
            query.unsqueeze(1),
            key.unsqueeze(1),
            value.unsqueeze(1),
            masked[None, None],
            attn_mask_type,
            attention_bias,
        )


def _explicit_attention(query, key, value, masked, scale) -> torch.Tensor:
    """Softmax attention of query [T, H, Dk] over key [T, G, Dk] / value [T, G, Dv] (G groups of
    heads), ``masked`` [T, T] True where a query must not see a key -> [T, 1, H * Dv]."""
    n, heads, dim = query.shape
    repeat = heads // key.shape[1]
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    scale = dim**-0.5 if scale is None else scale
    scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * scale
    probs = scores.masked_fill(masked, float("-inf")).softmax(-1).to(value.dtype)
    return torch.einsum("hqk,khd->qhd", probs, value).reshape(n, 1, -1)


@contextlib.contextmanager
def packed_sequences_in_local_attention() -> Iterator[None]:
    """While AReaL's stock (non-tree) engine builds its model: its forward packs a micro-batch's
    sequences THD (``PackedSeqParams`` from ``cu_seqlens``), which only TE's attention takes, and
    Megatron's local ``DotProductAttention`` (the local spec's, the only one on a CPU) asserts
    "Packed sequence is not supported"; the local spec's core attention is
    :class:`PackedDotProductAttention` inside the block. Tree engines build outside it (the tree
    spec replaces only Megatron's own core attention classes)."""
    from megatron.core.models import backends

    with swapped(backends, DotProductAttention=PackedDotProductAttention):
        yield


def use_local_spec_in_mbridge() -> None:
    """Without transformer-engine (always, on a CPU) mbridge 0.15.1's LLMBridge asks for the TE
    block spec (``get_gpt_decoder_block_spec(use_transformer_engine=True)`` -> TypeError:
    'NoneType' object is not callable). Build the local spec instead: a class-level change, so
    that AReaL's own tree patch, which wraps ``LLMBridge._get_transformer_layer_spec``, wraps it.
    The weight names and MoE options that go with it: :func:`local_spec_names_in_stock_mbridge`.
    Skipped without mbridge."""
    if not installed("mbridge"):
        return

    from mbridge.core import llm_bridge

    llm_bridge.LLMBridge._get_transformer_layer_spec = mbridge_local_layer_spec


def local_spec_names_in_stock_mbridge() -> None:
    """mbridge's weight maps name TE's fused norms (``linear_qkv.layer_norm_weight``,
    ``linear_fc1.layer_norm_weight``, MLA's ``linear_q_up_proj.layer_norm_weight``, ...) and TE's
    grouped experts (``mlp.experts.linear_fc1.weight{e}``); its MoE configs ask for grouped GEMM,
    apex's persistent norm and the shared-expert overlap's CUDA stream. The local spec has
    separate norms and SequentialMLP experts and builds none of those options. The bridges the
    package's patch makes handle this themselves
    (``megatron_tree.bridges.mbridge._extend_weight_maps_for_local_spec`` and
    ``_bind_local_moe``); the ones AReaL's ``_build_hf_mcore_bridge`` makes outside it (its stock
    engine, its own tree path) get the same two bindings here, after it, so they load HF
    checkpoints into the local spec (the same computation as TE's). Their configs are otherwise
    mbridge's own."""
    from areal.engine import megatron_engine

    from megatron_tree.bridges.mbridge import (
        _bind_local_moe,
        _extend_weight_maps_for_local_spec,
        is_tree_training_bridge,
    )

    build = megatron_engine.MegatronEngine._build_hf_mcore_bridge

    def build_hf_mcore_bridge(self):
        bridge = build(self)
        if self.bridge_cls == "mbridge" and not is_tree_training_bridge(bridge):
            _extend_weight_maps_for_local_spec(bridge)
            if bridge.config.num_moe_experts:
                _bind_local_moe(bridge)
        return bridge

    megatron_engine.MegatronEngine._build_hf_mcore_bridge = build_hf_mcore_bridge


@contextlib.contextmanager
def stock_megatron_bridge_on_cpu() -> Iterator[None]:
    """While AReaL's stock engine builds a Megatron-Bridge model
    (``bridge_type="megatron-bridge"``): a GPT provider's transformer-engine layer spec, which
    fails in ``provide()`` without transformer-engine (``TESpecProvider()`` -> TypeError:
    'NoneType' object is not callable), is Megatron-Bridge's local one (as the verl fixture's
    ``local_spec_in_megatron_bridge``). Other providers (a ``HybridModelProvider``: Nemotron-H)
    are left as they are. The package's tree engines build without it."""
    from megatron.bridge.models import gpt_provider
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge

    from megatron_tree.bridges.megatron_bridge import te_layer_specs

    original = AutoBridge.to_megatron_provider

    def to_megatron_provider(self, *args, **kwargs):
        provider = original(self, *args, **kwargs)
        if getattr(provider, "transformer_layer_spec", None) in te_layer_specs():
            provider.transformer_layer_spec = gpt_provider.local_layer_spec
        return provider

    with swapped(AutoBridge, to_megatron_provider=to_megatron_provider):
        yield


def setup_cpu(skip: str = "") -> None:
    """The process-wide stand-ins and patches, in order (``skip``: names to leave out, for
    ablation). Call once per process, before building an engine."""
    for step in (
        apply_megatron_cpu_patch,
        apply_mbridge_compat,
        use_local_spec_in_mbridge,
        redirect_cuda_in_optimizer_and_ddp,
        cpu_grad_clipping,
        import_megatron_bridge_without_te,
        import_areal,
        local_spec_names_in_stock_mbridge,
        cpu_local_rank_device,
        tokenizer_optional,
        no_checkpointer,
    ):
        if step.__name__ not in skip:
            step()
