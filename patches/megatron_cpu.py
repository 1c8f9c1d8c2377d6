"""Run Megatron-Core on a CPU-only torch build: an explicit, reversible runtime patch.

Megatron-Core (0.16.1, 0.17.x and 0.19.x verified) calls CUDA in a few places that tests and demos
on a CPU machine cannot avoid (model construction, the model-parallel RNG tracker, activation
recompute, the default causal mask, the MoE router and alltoall token dispatcher), and its CPU norms
refuse sequence parallelism. This module redirects exactly those calls to the CPU and lifts that one
refusal:

==========================================================  =======================================
patched symbol                                              CPU behaviour
==========================================================  =======================================
``torch.cuda.current_device``                               returns ``torch.device("cpu")``
``megatron.core.tensor_parallel.random._get_cuda_rng_state``  the CPU generator's state
``megatron.core.tensor_parallel.random._set_cuda_rng_state``  sets the CPU generator's state
``megatron.core.tensor_parallel.random.CudaRNGStatesTracker.add`` seeds a state on the CPU generator
``megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed`` (and its re-export in
                                                            ``megatron.core.tensor_parallel``) seeds
                                                            the CPU generator and the tracker states
``megatron.core.transformer.utils.get_default_causal_mask``  builds the mask on the CPU (also the
                                                            copy imported by
                                                            ``megatron.core.fusions.fused_softmax``)
``...utils.get_sliding_window_causal_mask``                 same, for sliding-window attention
``torch.cuda.synchronize``                                  no-op (called by the pipeline p2p code)
``megatron.core.pipeline_parallel.schedules.torch``         ``torch`` with ``zeros(device="cuda")``
                                                            redirected to the CPU (the schedules'
                                                            token counters)
``torch.nn.Module.cuda``                                    returns the module unchanged (model
                                                            builders such as mbridge's
                                                            ``get_model`` call it unconditionally)
``megatron.core.transformer.torch_norm.WrappedTorchNorm``   accepts ``sequence_parallel=True`` and
``.__new__``                                                marks the norm's parameters
                                                            ``sequence_parallel`` (see below)
``megatron.core.transformer.moe.token_dispatcher.torch``    ``torch`` with ``torch.cuda.Stream`` /
                                                            ``current_stream`` / ``stream`` as CPU
                                                            stand-ins (no-op streams and events):
                                                            the alltoall dispatcher's host-copy
                                                            stream
``...token_dispatcher.MoEAlltoAllTokenDispatcher``          a CPU stand-in stream, so the
``.cuda_dtoh_stream``                                       constructor creates no CUDA stream
``...token_dispatcher.maybe_move_tensor_to_cpu``            ``as_numpy=True`` gives a NumPy array
                                                            for a CPU tensor too (upstream converts
                                                            only CUDA tensors), so the all-to-all
                                                            gets its split sizes as on a GPU
``megatron.core.transformer.moe.shared_experts.torch``      ``torch`` with the CPU stand-in streams:
                                                            the shared experts' overlap stream
                                                            (``moe_shared_expert_overlap``, on in
                                                            DeepSeek-V3 / GLM-4.5 bridges)
``megatron.core.transformer.multi_latent_attention.HAVE_TE`` ``False`` where it is True (0.16.x
stubs
                                                            TE's classes with mocks when it is
                                                            missing, so its MLA reads True and fails
                                                            in ``isinstance(..., TELinear)``; 0.17
                                                            and 0.19 read False: untouched)
``...embeddings.rope_utils.get_pos_emb_on_this_cp_rank``    the same zigzag slice with a CPU index
(and its copies in ``rotary_pos_embedding`` and             (upstream builds it with
``yarn_rotary_pos_embedding``)                              ``pin_memory=True`` and ``.cuda()``;
                                                            YaRN calls it in its constructor at CP >
                                                            1)
``megatron.core.transformer.moe.moe_utils.te_general_gemm``  defined as ``None`` where it is missing
                                                            (megatron-core 0.16.x without
                                                            transformer-engine; 0.17+ define it);
                                                            :func:`undo` deletes it again
==========================================================  =======================================

Mixture of experts. megatron-core 0.16.1 imports ``te_general_gemm`` in ``moe/moe_utils.py`` only
inside ``try: import transformer_engine``, but the router's ``RouterGatingLinearFunction`` reads it
unconditionally, so every MoE forward without transformer-engine raises ``NameError: name
'te_general_gemm' is not defined`` (0.17 and 0.19 set it to None in an ``else`` branch: nothing to
do there). The alltoall token dispatcher (``moe_token_dispatcher_type="alltoall"``, all three
versions) creates ``torch.cuda.Stream()`` in its constructor and moves its split sizes to the host
on that stream (``_maybe_dtoh_and_synchronize``: ``torch.cuda.current_stream``,
``torch.cuda.stream``, ``record_event``). On a CPU the tensors are already on the host, so the
stand-in streams do nothing, which is exactly the synchronous behaviour the code falls back to. That
host copy also turns the split sizes into NumPy arrays for ``all_to_all_single``; upstream skips
tensors that are not on CUDA, and a torch tensor as split sizes is a ``TypeError`` (``incompatible
function arguments``), so the patched copy converts CPU tensors as well. The allgather dispatcher
needs neither. The flex dispatcher (DeepEP / HybridEP) is GPU-only and not covered.

Sequence parallelism on the local spec. Without apex or transformer-engine (always the case on a
CPU) the local spec's norms are ``WrappedTorchNorm``, a factory for ``torch.nn.LayerNorm`` /
``RMSNorm`` that asserts ``not config.sequence_parallel`` (megatron-core 0.16.1, 0.17.0 and 0.19.2
alike). The assertion guards nothing a CPU run needs: under sequence parallelism a norm sees its
rank's shard of the sequence, [s/tp, b, H], and a LayerNorm / RMSNorm is computed per token, so its
output on a shard is the shard of its output on the whole sequence. Only its weight (and bias)
gradient differs: each rank sums over its own tokens, so the full gradient is the sum over the
tensor-parallel ranks. Megatron already does that sum for every parameter marked
``param.sequence_parallel = True`` (``finalize_model_grads`` ->
``_allreduce_non_tensor_model_parallel_grads``, a SUM over the TP group, run when
``config.sequence_parallel``), and its own sequence-parallel norms (apex ``FusedLayerNorm``,
transformer-engine ``TENorm``) mark their parameters so. The patched factory therefore builds the
same torch norm, with every other assertion of the original left in force (it calls the original
on a shallow copy of the config with ``sequence_parallel=False``), and sets
``param.sequence_parallel = config.sequence_parallel`` on its parameters, as ``FusedLayerNorm``
does. (A ``qk_layernorm`` q/k norm sees the whole sequence but only its rank's heads; its gradient
is a partial sum too, which ``finalize_model_grads`` adds up by name with or without sequence
parallelism.) A caller that does not use ``finalize_model_grads`` (a hand-written loop without
Megatron DDP) must all-reduce the gradients of the parameters so marked over the TP group itself.

Nothing happens at import. Use :func:`apply` / :func:`undo` or the :func:`megatron_cpu_patch`
context manager. On a machine where CUDA is available every entry point is a no-op. The patch is
for tests and demos: the CPU generator then plays the role of the CUDA generator, so weight init
and dropout inside ``get_cuda_rng_tracker().fork()`` draw from the CPU generator. Megatron logs
"CPU RNG state changed within GPU RNG context" on each such draw; that is expected here, so
:func:`apply` filters that one message out of Megatron's RNG logger and :func:`undo` removes the
filter.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import logging
import warnings
from typing import Any

import torch

from ._scoped import scoped

# megatron-core minor series on which every target resolves and the suite passes on a CPU.
VERIFIED_MEGATRON_CORE = ("0.16", "0.17", "0.19")

# (module path, attribute path inside the module). Attribute paths may be dotted (class.method).
_TARGETS: tuple[tuple[str, str], ...] = (
    ("torch.cuda", "current_device"),
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state"),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.add"),
    ("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed"),
    ("megatron.core.tensor_parallel", "model_parallel_cuda_manual_seed"),
    ("megatron.core.transformer.utils", "get_default_causal_mask"),
    ("megatron.core.transformer.utils", "get_sliding_window_causal_mask"),
    ("megatron.core.fusions.fused_softmax", "get_default_causal_mask"),
    ("megatron.core.fusions.fused_softmax", "get_sliding_window_causal_mask"),
    ("torch.cuda", "synchronize"),
    ("megatron.core.pipeline_parallel.schedules", "torch"),
    ("torch.nn", "Module.cuda"),
    ("megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__"),
    ("megatron.core.transformer.moe.token_dispatcher", "torch"),
    (
        "megatron.core.transformer.moe.token_dispatcher",
        "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream",
    ),
    ("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu"),
    ("megatron.core.transformer.moe.shared_experts", "torch"),
    ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank"),
    (
        "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
        "get_pos_emb_on_this_cp_rank",
    ),
)

# (module path, name, value): module globals that some versions read but never define; defined
# while the patch is applied, only where missing, and deleted again by undo.
_DEFINE_IF_MISSING: tuple[tuple[str, str, Any], ...] = (
    ("megatron.core.transformer.moe.moe_utils", "te_general_gemm", None),
)
_ABSENT = object()  # the "original" of a name that did not exist before apply
# (module path, name): flags that some versions set True without transformer-engine (0.16.x stubs
# TE's classes with mocks); set False while applied, only where True, and put back by undo.
_FALSE_WHERE_TRUE: tuple[tuple[str, str], ...] = (
    ("megatron.core.transformer.multi_latent_attention", "HAVE_TE"),
)

# (owner object, attribute name, original value) for every patched attribute, in apply order.
_saved: list[tuple[Any, str, Any]] = []


class _ExpectedRngWarningFilter(logging.Filter):
    """Drops Megatron's "CPU RNG state changed within GPU RNG context": under this patch the CPU
    generator *is* the tracked generator, so every draw inside ``fork()`` (weight init, dropout)
    changes it by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_RNG_LOGGER = "megatron.core.tensor_parallel.random"
_rng_filter = _ExpectedRngWarningFilter()


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    # torch.get_rng_state() already returns a fresh copy, so `clone` needs no extra work.
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    saved = torch.get_rng_state()
    # torch.manual_seed would also seed CUDA generators (and, under this patch, recurse through
    # the lazy CUDA seeding machinery); seed the CPU generator alone.
    torch.default_generator.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(saved)


def _cpu_model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    force_reset_rng: bool = False,
) -> None:
    """CPU stand-in for Megatron's model_parallel_cuda_manual_seed, with the same seed layout."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    if te_rng_tracker or use_cudagraphable_rng:
        raise ValueError(
            "the CPU patch supports only Megatron's own RNG tracker: pass te_rng_tracker=False and "
            "use_cudagraphable_rng=False"
        )
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank()
    if etp_rank is None:
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
    mp_random.initialize_rng_tracker(
        False, inference_rng_tracker, False, force_reset=force_reset_rng
    )
    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
    # Same seeds as upstream: data parallel = seed, tensor parallel = seed + 2718 + tp_rank,
    # expert parallel = seed + 1024 + 100 * ep_rank + etp_rank. The "default CUDA generator" is the
    # CPU generator here, so it gets the data-parallel seed.
    torch.default_generator.manual_seed(seed)
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    allowed = torch.ones(sq, skv, dtype=torch.bool)
    allowed = torch.triu(allowed, diagonal=skv - sq - window_size[0])
    allowed = torch.tril(allowed, diagonal=skv - sq + window_size[1])
    return ~allowed


def _cpu_synchronize(device: Any = None) -> None:
    # No CUDA stream exists, so there is nothing to wait for (the pipeline's p2p code calls this).
    return None


class _TorchWithCpuZeros:
    """``torch`` as seen by Megatron's pipeline schedules, whose token counters are created with
    ``torch.zeros(..., device="cuda")``: the same module, with that one device redirected."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*args, device=device, **kwargs)


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: everything already happened."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream``: work on a CPU is synchronous, so waiting is a no-op."""

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        return None


_CPU_CURRENT_STREAM = _CpuStream()


class _CudaWithCpuStreams:
    """``torch.cuda`` with ``Stream`` / ``Event`` / ``current_stream`` / ``stream`` on the CPU."""

    Stream = _CpuStream
    Event = _CpuEvent

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_stream(device: Any = None) -> _CpuStream:
        return _CPU_CURRENT_STREAM

    @staticmethod
    def stream(stream: Any):
        return contextlib.nullcontext()


class _TorchWithCpuStreams:
    """``torch`` as seen by Megatron's MoE token dispatchers: the same module, with ``torch.cuda``'s
    streams and events replaced by CPU stand-ins."""

    cuda = _CudaWithCpuStreams()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _cpu_maybe_move_tensor_to_cpu(
    tensor: Any, as_numpy: bool = False, record_stream: bool = False
) -> Any:
    """Megatron's ``maybe_move_tensor_to_cpu`` for tensors already on the CPU: ``as_numpy`` still
    gives a NumPy array (what the all-to-all's split sizes must be)."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().cpu().numpy()
    return tensor


def _cpu_pos_emb_on_this_cp_rank(
    pos_emb: torch.Tensor, seq_dim: int, cp_group: Any
) -> torch.Tensor:
    """Megatron's zigzag slice of a rotary table for a context-parallel rank (chunks ``r`` and
    ``2 cp - r - 1`` of ``2 cp``), with its index on the CPU (upstream pins it and copies it to
    CUDA)."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


def _module_cuda_noop(self, device: Any = None):
    # No CUDA device exists: keep the module where it is (on the CPU).
    return self


def _original(cls: type, name: str) -> Any:
    """The object this patch replaced at ``name`` on ``cls`` or a base class (while applied)."""
    for saved_owner, saved_name, original in _saved:
        if saved_owner in cls.__mro__ and saved_name == name:
            return original
    raise AssertionError(f"{cls.__name__}.{name} is not patched")


def _torch_norm_new(cls, config, hidden_size: int, eps: float = 1e-5, *args: Any, **kwargs: Any):
    """``WrappedTorchNorm(config, hidden_size, ...)`` that allows ``config.sequence_parallel``.

    Returns the torch norm upstream builds (every other upstream assertion still applies), its
    parameters marked ``sequence_parallel = config.sequence_parallel`` so that Megatron's
    ``finalize_model_grads`` sums their gradients over the tensor-parallel group.
    """
    original = _original(cls, "__new__")
    upstream_config = config
    if config.sequence_parallel:
        upstream_config = copy.copy(
            config
        )  # shallow: no __post_init__, the model's config untouched
        upstream_config.sequence_parallel = False
    norm = original.__get__(None, cls)(cls, upstream_config, hidden_size, eps, *args, **kwargs)
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    return norm


_REPLACEMENTS: dict[str, Any] = {
    "WrappedTorchNorm.__new__": staticmethod(_torch_norm_new),
    "Module.cuda": _module_cuda_noop,
    "current_device": _cpu_current_device,
    "_get_cuda_rng_state": _cpu_get_rng_state,
    "_set_cuda_rng_state": _cpu_set_rng_state,
    "CudaRNGStatesTracker.add": _cpu_tracker_add,
    "model_parallel_cuda_manual_seed": _cpu_model_parallel_cuda_manual_seed,
    "get_default_causal_mask": _cpu_default_causal_mask,
    "get_sliding_window_causal_mask": _cpu_sliding_window_causal_mask,
    "synchronize": _cpu_synchronize,
    ("megatron.core.pipeline_parallel.schedules", "torch"): _TorchWithCpuZeros(),
    ("megatron.core.transformer.moe.token_dispatcher", "torch"): _TorchWithCpuStreams(),
    "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream": _CpuStream(),
    "maybe_move_tensor_to_cpu": _cpu_maybe_move_tensor_to_cpu,
    ("megatron.core.transformer.moe.shared_experts", "torch"): _TorchWithCpuStreams(),
    "get_pos_emb_on_this_cp_rank": _cpu_pos_emb_on_this_cp_rank,
}


def _replacement(module_name: str, attr_path: str) -> Any:
    key = (module_name, attr_path)
    return _REPLACEMENTS[key] if key in _REPLACEMENTS else _REPLACEMENTS[attr_path]


def _resolve(module_name: str, attr_path: str) -> tuple[Any, str]:
    """(owner object, final attribute name); raises AttributeError/ImportError when absent."""
    owner: Any = importlib.import_module(module_name)
    *parents, name = attr_path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    getattr(owner, name)
    return owner, name


def _megatron_version() -> str:
    import megatron.core

    return getattr(megatron.core, "__version__", "unknown")


def is_applied() -> bool:
    """True while the patch is in effect."""
    return bool(_saved)


def apply() -> bool:
    """Apply the CPU patch. Idempotent; a no-op when CUDA is available.

    Returns:
        True if the patch is in effect after the call, False on a CUDA machine.

    Raises:
        RuntimeError: a symbol this patch replaces does not exist in the installed megatron-core
            (verified on megatron-core ``VERIFIED_MEGATRON_CORE``).
    """
    if torch.cuda.is_available():
        return False
    if _saved:
        return True
    resolved, missing = [], []
    for module_name, attr_path in _TARGETS:
        try:
            resolved.append((*_resolve(module_name, attr_path), module_name, attr_path))
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{attr_path}")
    if missing:
        raise RuntimeError(
            "megatron_tree.patches.megatron_cpu is verified on megatron-core "
            f"{VERIFIED_MEGATRON_CORE}, but the installed megatron-core {_megatron_version()} "
            f"lacks: {', '.join(missing)}. Install a verified version or update "
            "patches/megatron_cpu.py."
        )
    version = _megatron_version()
    if ".".join(version.split(".")[:2]) not in VERIFIED_MEGATRON_CORE:
        warnings.warn(
            f"megatron_cpu patch is verified on megatron-core {VERIFIED_MEGATRON_CORE}, found "
            f"{version}",
            stacklevel=2,
        )
    for owner, name, module_name, attr_path in resolved:
        # Read from __dict__ so that undo restores exactly what was there (e.g. a plain function
        # on a class rather than a bound method).
        original = vars(owner)[name] if name in vars(owner) else getattr(owner, name)
        _saved.append((owner, name, original))
        setattr(owner, name, _replacement(module_name, attr_path))
    for module_name, name, value in _DEFINE_IF_MISSING:
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            _saved.append((module, name, _ABSENT))
            setattr(module, name, value)
    for module_name, name in _FALSE_WHERE_TRUE:
        module = importlib.import_module(module_name)
        if getattr(module, name, False) is True:
            _saved.append((module, name, True))
            setattr(module, name, False)
    logging.getLogger(_RNG_LOGGER).addFilter(_rng_filter)
    return True


def undo() -> None:
    """Restore every patched symbol. Idempotent; a no-op when the patch is not applied."""
    while _saved:
        owner, name, original = _saved.pop()
        if original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    logging.getLogger(_RNG_LOGGER).removeFilter(_rng_filter)


def megatron_cpu_patch():
    """Context manager form of :func:`apply` / :func:`undo`; yields whether the patch is in effect.

    Only the outermost block that actually applied the patch undoes it.
    """
    return scoped(apply, undo, is_applied)
