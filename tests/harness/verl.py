"""verl 0.9.1's Megatron engine on a CPU-only machine, for tests: stand-ins, an engine builder and
a GRPO-style batch in verl's layout.

The stand-ins are process-wide and not undone (run them in a spawned worker); each is one need,
found by removing it and reading the failure. None of them is needed by the adapter
(:mod:`megatron_tree.integrations.verl`) on a GPU machine.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import tempfile
import types
from contextlib import contextmanager, nullcontext

import torch

from megatron_tree.patches._scoped import swapped

from .dist import installed


def apply_megatron_cpu_patch() -> None:
    """megatron_tree's reversible CPU runtime patch: torch.cuda.current_device -> cpu, Megatron's
    CUDA RNG tracker on the CPU generator, CPU causal masks, Module.cuda() a no-op, ..."""
    from megatron_tree.patches import megatron_cpu

    megatron_cpu.apply()


def init_gloo_world() -> None:
    """One-process gloo world (verl's engine expects torch.distributed to be initialized), meeting
    through a file, not a TCP port that two test processes at once would race for."""
    if torch.distributed.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    rendezvous = os.path.join(tempfile.mkdtemp(), "rendezvous")
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1
    )


def register_cpu_platform() -> None:
    """A verl platform (``verl.plugin.platform``) whose device is "cpu":
    :class:`~harness.verl_platform.PlatformCPU`, registered as "cpu" and set as
    verl's platform. The engine registry has no "cpu" key for megatron, so the lookup is pointed
    at the CUDA registration with ``VERL_ENGINE_DEVICE=cuda`` (base.py reads it on every
    lookup)."""
    from verl.plugin.platform import set_platform

    from .verl_platform import PlatformCPU  # imports verl; registers the platform

    set_platform(PlatformCPU())
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"


def router_replay_on_cpu() -> None:
    """verl's router replay utilities pick their device once, at import (``device_name =
    get_device_name()`` in ``verl/utils/megatron/router_replay_utils.py``), as "cuda" when the
    module is imported before the CPU platform is set; recording routes then moves them to CUDA
    ("Found no NVIDIA driver"). Point it at the CPU."""
    from verl.utils.megatron import router_replay_utils

    router_replay_utils.device_name = "cpu"


def seed_megatron_rng_tracker(seed: int = 42) -> None:
    """verl's set_random_seed (engine/megatron/utils.py) skips model_parallel_cuda_manual_seed
    when no accelerator is present, and Megatron's layers then fail in get_cuda_rng_tracker().fork()
    ("cuda rng state model-parallel-rng is not added"). Under the CPU patch the call seeds the CPU
    generator's tracker states."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def force_fp32(engine_config) -> None:
    """McoreEngineConfig.__post_init__ accepts only bfloat16/float16 and the field is frozen;
    PrecisionType.to_dtype("fp32") gives torch.float32, which the engine passes to the bridge."""
    object.__setattr__(engine_config, "dtype", "fp32")


def apply_mbridge_compat() -> None:
    """Not CPU-specific: mbridge 0.15.1's get_model compares with ModelType.encoder_and_decoder,
    which megatron-core >= 0.17 removed (AttributeError). megatron_tree's version-gated patch puts
    0.16.1's deprecated property back (a no-op where not needed). Skipped without mbridge."""
    if not installed("mbridge"):
        return
    from megatron_tree.patches import mbridge_compat

    mbridge_compat.apply()


# local-spec parameter name -> the TE-spec name mbridge maps (TE fuses these norms into the linears)
_LOCAL_TO_TE_NAMES = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


def mbridge_local_layer_spec(self, vp_stage=None):
    """``LLMBridge._get_transformer_layer_spec`` on Megatron-Core's local (non-TE) modules: the GPT
    decoder block spec with ``use_transformer_engine=False``, ``vp_stage`` passed where this
    megatron-core takes it."""
    import inspect

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    self.has_vp_stage = "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters
    extra = {"vp_stage": vp_stage} if self.has_vp_stage else {}
    return get_gpt_decoder_block_spec(
        self.config,
        use_transformer_engine=False,
        normalization=self.config.normalization,
        **extra,
    )


def use_local_spec_in_mbridge() -> None:
    """Without transformer-engine (always, on a CPU) mbridge 0.15.1's LLMBridge asks for the TE
    block spec (``get_gpt_decoder_block_spec(use_transformer_engine=True)`` -> TypeError:
    'NoneType' object is not callable). Build the local spec instead, and translate the local
    spec's separate norm names to the fused TE names before mbridge maps them to HF (load and
    export). Dense GPT bridges only (Qwen2/Qwen3/Llama). Skipped without mbridge."""
    if not installed("mbridge"):
        return

    from mbridge.core import bridge as bridge_module
    from mbridge.core import llm_bridge

    original = bridge_module.Bridge._weight_name_mapping_mcore_to_hf

    def mcore_to_hf(self, name):
        for local, te in _LOCAL_TO_TE_NAMES.items():
            # an MoE layer's pre-MLP norm is a module of its own with TE too
            moe = local == ".pre_mlp_layernorm.weight" and self.config.num_moe_experts
            if name.endswith(local) and not moe:
                name = name[: -len(local)] + te
        return original(self, name)

    llm_bridge.LLMBridge._get_transformer_layer_spec = mbridge_local_layer_spec
    bridge_module.Bridge._weight_name_mapping_mcore_to_hf = mcore_to_hf


def local_moe_in_stock_mbridge() -> None:
    """For verl's STOCK engine on the mbridge path with an MoE checkpoint: mbridge's MoE configs ask
    for grouped GEMM and apex's persistent norm (the torch norms assert it off: "persist_layer_norm
    not supported by torch LayerNorm") and its weight maps name TE's grouped experts; the bridges
    that ``AutoBridge.from_config`` returns while ``VERL_ENGINE_VENDOR`` is unset get the package's
    local-MoE binding (``megatron_tree.bridges.mbridge._bind_local_moe``: SequentialMLP experts,
    their names mapped to the global expert), as the tree engine's bridges get it from the
    package's patch. Skipped without mbridge."""
    if not installed("mbridge"):
        return
    from mbridge import AutoBridge

    from megatron_tree.bridges.mbridge import _bind_local_moe

    original = AutoBridge.from_config.__func__

    def from_config(cls, *args, **kwargs):
        bridge = original(cls, *args, **kwargs)
        if bridge.config.num_moe_experts and not os.environ.get("VERL_ENGINE_VENDOR"):
            _bind_local_moe(bridge)
        return bridge

    AutoBridge.from_config = classmethod(from_config)


class _NoStream:
    """A CPU stand-in for a CUDA stream: work on the CPU is already synchronous."""

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return event


class _CudaOnCpu:
    """``torch.cuda`` with no-op streams; everything else is torch.cuda itself."""

    def current_stream(self, device=None):
        return _NoStream()

    def stream(self, stream):
        return nullcontext()

    def Stream(self, *args, **kwargs):
        return _NoStream()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """``torch`` as one Megatron module sees it: factory calls with ``device="cuda"`` build CPU
    tensors, ``torch.cuda`` streams are no-ops; everything else is torch itself."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full")
    cuda = _CudaOnCpu()

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name not in self._FACTORIES:
            return value

        def factory(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)

        return factory


# Megatron modules that create small state tensors with device="cuda" on the training path:
# FP32Optimizer._scale (optimizer.py:1249, at optimizer construction), the grad-norm / zero-count
# buffers of clip_grads.py (:96-231, at optimizer.step()); and DDP's bucket-group grad sync, which
# reads torch.cuda.current_stream() (param_and_grad_buffer.py:632, in finalize_model_grads); and
# the apex-free l2 norm that clip_grads falls back to (megatron/core/utils.py:1332,
# local_multi_tensor_l2_norm). On verl's Megatron-Bridge path also the DDP wrapper that
# Megatron-Bridge's get_model calls (megatron/training/models/dist_utils.py:303, _ddp_wrap:
# ``torch.cuda.Stream()`` -> "CUDA driver version is insufficient for CUDA runtime version").
_CUDA_FACTORY_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
    "megatron.training.models.dist_utils",
)


def redirect_cuda_in_optimizer_and_ddp() -> None:
    import importlib

    for name in _CUDA_FACTORY_MODULES:
        importlib.import_module(name).torch = _TorchOnCpu()


def bshd_padding_mask_for_local_attention(engine) -> None:
    """verl's BSHD path hands the model a [B, S] bool mask, True = real token
    (models/mcore/util.py preprocess_bshd_engine); TE's causal attention ignores it, but Megatron's
    local DotProductAttention (the only one on a CPU) reads a [B, 1, S, S] mask, True = masked, and
    the [B, S] one fails in masked_fill_ ("size of tensor a (S) must match ... b (B)"). A forward
    pre-hook on each model chunk turns it into causal | padded-key. Call after
    engine.initialize()."""
    from verl.utils.megatron_utils import unwrap_model

    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2 and mask.dtype == torch.bool:
            s = mask.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).triu(1)
            kwargs["attention_mask"] = causal[None, None] | ~mask[:, None, None, :]
        return args, kwargs

    for chunk in engine.module:
        unwrap_model(chunk).register_forward_pre_hook(hook, with_kwargs=True)


def cpu_grad_clipping() -> None:
    """clip_grad_by_total_norm_fp32 asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``
    (clip_grads.py:174) whenever clip_grad > 0 (verl's default 1.0). The stand-in scales the
    same gradients by the same min(1, max_norm / (total_norm + 1e-6))."""
    from megatron.core.optimizer import clip_grads, optimizer

    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [
            getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None
        ]
        coeff = max_norm / (total_norm + 1.0e-6)
        if isinstance(coeff, torch.Tensor):
            coeff = coeff.clamp_max(1.0)
        elif coeff >= 1.0:
            return
        torch._foreach_mul_(grads, coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def import_megatron_bridge_without_te() -> None:
    """verl's Megatron-Bridge path (``vanilla_mbridge=False``) imports ``from megatron.bridge import
    AutoBridge`` (verl/models/mcore/bridge.py), which without transformer-engine raises
    ``ModuleNotFoundError: No module named 'transformer_engine'``
    (megatron/bridge/peft/lora_layers.py imports it unguarded). megatron_tree's import patch
    (``megatron_tree.patches.megatron_bridge_te``,
    a no-op with transformer-engine) lets it import. Skipped without Megatron-Bridge."""
    if not installed("megatron.bridge"):
        return
    from megatron_tree.patches import megatron_bridge_te

    megatron_bridge_te.apply()


@contextmanager
def local_spec_in_megatron_bridge():
    """For verl's STOCK engine on the Megatron-Bridge path, inside the block: the providers that
    ``AutoBridge.to_megatron_provider`` returns use Megatron-Bridge's local layer spec instead of
    its default transformer-engine spec, which without transformer-engine fails in ``provide()``
    (gpt_layer_specs.py:233, ``TESpecProvider()`` -> TypeError: 'NoneType' object is not callable).
    Of the TE-only fusions that ``megatron_tree.bridges.megatron_bridge.make_tree_provider``
    switches off, only the MoE ones are needed here (dense Qwen3: removing the others changes
    nothing). The tree engine needs none of
    it."""
    from megatron.bridge.models import gpt_provider
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge

    from megatron_tree.bridges.megatron_bridge import te_layer_specs
    from megatron_tree.patches import megatron_bridge_experts

    original = AutoBridge.to_megatron_provider

    def to_megatron_provider(self, *args, **kwargs):
        provider = original(self, *args, **kwargs)
        if provider.transformer_layer_spec in te_layer_specs():
            provider.transformer_layer_spec = gpt_provider.local_layer_spec
        if provider.num_moe_experts:
            # TE-only MoE fusions ("fused permutation is not available. Please install TE"), and
            # the local spec's SequentialMLP experts loaded by name (the package's import patch)
            provider.moe_permute_fusion = provider.moe_grouped_gemm = False
            megatron_bridge_experts.apply()
        return provider

    with swapped(AutoBridge, to_megatron_provider=to_megatron_provider):
        yield


def give_pad_token(model_config, pad_token_id: int = 0) -> None:
    """The engine's forward step reads ``model_config.tokenizer.pad_token_id`` unconditionally
    (transformer_impl.py:1405 / 1525); a tiny random checkpoint has no tokenizer
    (HFModelConfig(load_tokenizer=False))."""
    from types import SimpleNamespace

    if model_config.tokenizer is None:
        model_config.tokenizer = SimpleNamespace(pad_token_id=pad_token_id)


def setup_cpu(skip: str = "") -> None:
    """The process-wide stand-ins, in order (``skip``: names to leave out, for ablation). The
    per-config / per-engine ones are called by the script: give_pad_token, force_fp32,
    seed_megatron_rng_tracker (after EngineRegistry.new), bshd_padding_mask_for_local_attention
    (after engine.initialize())."""
    for step in (
        apply_megatron_cpu_patch,
        apply_mbridge_compat,
        use_local_spec_in_mbridge,
        local_moe_in_stock_mbridge,
        import_megatron_bridge_without_te,
        redirect_cuda_in_optimizer_and_ddp,
        cpu_grad_clipping,
        init_gloo_world,
        register_cpu_platform,
        router_replay_on_cpu,
    ):
        if step.__name__ not in skip:
            step()


def build_engine(
    path: str,
    *,
    vendor: str | None,
    model_type: str = "language_model",
    micro_batch_size: int = 2,
    lr: float = 1e-3,
    clip_grad: float = 1.0,
    tree_max_tokens: int = 128,
    vanilla_mbridge: bool = True,
    parallel: dict | None = None,
    use_remove_padding: bool = False,
    override_transformer_config: dict | None = None,
    router_replay: str = "disabled",
):
    """verl's Megatron engine of ``model_type`` ("language_model" or "value_model") for the HF
    checkpoint at ``path`` (fp32, BSHD), chosen by ``VERL_ENGINE_VENDOR=vendor`` (None: verl's own);
    initialized. ``vanilla_mbridge``: verl's mbridge path (True) or its default Megatron-Bridge path
    (False; verl's stock engine then builds inside :func:`local_spec_in_megatron_bridge`).
    ``parallel``: the layout, ``{"tp", "pp", "vpp", "cp", "ep"}`` sizes (default 1 each, the rest
    of the world data parallel) and ``"sp"`` (sequence parallelism, with TP > 1; default False);
    verl initializes Megatron's parallel state with it unless it is already
    (:func:`reset_model_parallel` between layouts). ``use_remove_padding`` (verl's THD
    path; only the tree engine runs it on a CPU) and ``override_transformer_config`` go to verl's
    engine config; ``lr`` and ``clip_grad`` to its optimizer (a ``clip_grad`` above the gradient
    norm leaves the gradients as the loss made them, so that a normalization error shows).
    ``router_replay``: verl's routing replay mode ("disabled", "R2", "R3")."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.config.engine import EngineRouterReplayConfig
    from verl.workers.engine import EngineRegistry

    if vendor:
        os.environ["VERL_ENGINE_VENDOR"] = vendor
    else:
        os.environ.pop("VERL_ENGINE_VENDOR", None)
    model_config = HFModelConfig(path=path, load_tokenizer=False, model_type=model_type)
    give_pad_token(model_config)
    sizes = {"tp": 1, "pp": 1, "vpp": None, "cp": 1, "ep": 1, "sp": False, **(parallel or {})}
    engine_config = McoreEngineConfig(
        strategy="megatron",
        vanilla_mbridge=vanilla_mbridge,
        use_remove_padding=use_remove_padding,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch_size,
        use_distributed_optimizer=False,
        sequence_parallel=sizes["sp"],
        tensor_model_parallel_size=sizes["tp"],
        pipeline_model_parallel_size=sizes["pp"],
        virtual_pipeline_model_parallel_size=sizes["vpp"],
        context_parallel_size=sizes["cp"],
        expert_model_parallel_size=sizes["ep"],
        router_replay=EngineRouterReplayConfig(mode=router_replay),
        override_transformer_config=dict(override_transformer_config or {}),
    )
    force_fp32(engine_config)
    engine = EngineRegistry.new(
        model_type=model_type,
        backend="megatron",
        model_config=model_config,
        engine_config=engine_config,
        checkpoint_config=CheckpointConfig(),
        optimizer_config=McoreOptimizerConfig(lr=lr, clip_grad=clip_grad, total_training_steps=10),
    )
    seed_megatron_rng_tracker(engine_config.seed)
    if vendor:
        engine.tree_block_size, engine.tree_max_tokens, engine.tree_backend = (
            16,
            tree_max_tokens,
            "block_sparse",
        )
    stock_on_megatron_bridge = not vendor and not vanilla_mbridge
    with local_spec_in_megatron_bridge() if stock_on_megatron_bridge else nullcontext():
        engine.initialize()
    if not vendor:
        bshd_padding_mask_for_local_attention(engine)
    return engine, model_config


def reset_model_parallel() -> None:
    """Megatron's parallel state destroyed, so that the next engine built initializes it with its
    own layout (verl keeps an initialized one)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def engine_grads(engine) -> dict[str, torch.Tensor]:
    """This rank's DDP gradient buffers (``main_grad``) of every model chunk, by name (chunk
    ``c`` > 0 of a virtual pipeline prefixed ``chunk{c}.``); read inside ``engine.train_mode()``."""
    from megatron_tree.testing.reference import parameter_grads

    grads = {}
    for c, chunk in enumerate(engine.module):
        for name, grad in parameter_grads(chunk, main_grad=True, require_all=True).items():
            grads[f"chunk{c}.{name}" if c else name] = grad
    return grads


def rollout_batch(
    vocab: int,
    *,
    prompts: int = 3,
    samples: int = 2,
    seed: int = 0,
    prompt_tokens: tuple[int, int] = (5, 12),
):
    """verl's rollout layout ({prompts [B, P] left-padded, responses [B, R] right-padded, input_ids,
    attention_mask, response_mask, position_ids}) for ``prompts`` x ``samples`` sequences sharing
    their prompt (of ``prompt_tokens`` [low, high) tokens), and the sequences themselves."""
    g = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(prompts):
        prompt = torch.randint(
            1, vocab, (int(torch.randint(*prompt_tokens, (1,), generator=g)),), generator=g
        )
        pairs += [
            (
                prompt,
                torch.randint(
                    1, vocab, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g
                ),
            )
            for _ in range(samples)
        ]
    return rollout_layout(pairs)


def rollout_layout(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[dict, list[torch.Tensor]]:
    """verl's rollout layout of (prompt, response) pairs (1-D each): {prompts [B, P] left-padded,
    responses [B, R] right-padded, input_ids [B, P + R], attention_mask, response_mask [B, R],
    position_ids}, and the sequences themselves."""
    width_p, width_r = max(len(p) for p, _ in pairs), max(len(r) for _, r in pairs)
    batch = {
        k: torch.zeros(len(pairs), w, dtype=torch.long)
        for k, w in (
            ("prompts", width_p),
            ("responses", width_r),
            ("attention_mask", width_p + width_r),
            ("response_mask", width_r),
        )
    }
    for i, (p, r) in enumerate(pairs):
        batch["prompts"][i, width_p - len(p) :] = p
        batch["responses"][i, : len(r)] = r
        batch["attention_mask"][i, width_p - len(p) : width_p + len(r)] = 1
        batch["response_mask"][i, : len(r)] = 1
    batch["input_ids"] = torch.cat([batch["prompts"], batch["responses"]], 1)
    batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)
    return batch, [torch.cat(pair) for pair in pairs]


def engine_batch(padded: dict, micro_batch_size: int = 2, **meta):
    """``padded`` as the engine takes it: verl's own ``left_right_2_no_padding`` (jagged input ids
    and positions, ``loss_mask`` = the response mask) with the batch's non-tensor settings
    (``meta`` adds to or replaces the defaults, e.g. ``max_token_len_per_gpu``)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    td = left_right_2_no_padding(tu.get_tensordict({k: v.clone() for k, v in padded.items()}))
    settings = dict(
        temperature=1.0,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch_size,
        max_token_len_per_gpu=4096,
        use_fused_kernels=False,
    )
    tu.assign_non_tensor(td, **{**settings, **meta})
    return td


class _StubModule(types.ModuleType):
    """An empty stand-in module: any attribute is a new empty class."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


class _StubFinder:
    """Finds every module under the top-level names ``roots`` as a :class:`_StubModule`."""

    def __init__(self, roots: tuple[str, ...]):
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def stub_modules(*roots: str) -> None:
    """Empty stand-ins for the top-level modules ``roots`` (and their submodules): any attribute is
    a new empty class. Appended last to ``sys.meta_path``, so an installed module is used as is.
    verl's trainer module imports its data loader (torchdata) and rollout router (cachetools) at
    import time; the balancing test below needs neither."""
    sys.meta_path.append(_StubFinder(roots))


def balance_with_verls_trainer(dp_sizes=(2, 4), seed: int = 0) -> dict:
    """Run in a fresh process: import verl and then verl's trainer module
    (``verl.trainer.ppo.ray_trainer``, its two missing imports stubbed, see :func:`stub_modules`)
    as verl's ``TaskRunner`` does, and balance a GRPO-style batch (8 prompts x 4 samples in
    shuffled order, as verl's batches come) with ``RayPPOTrainer._balance_batch`` as it is after
    the import, for each data-parallel size. Returns, per size, the prompt groups (uids) of each
    rank's equal chunk, and whether the method is megatron_tree's."""
    import logging
    import types

    import numpy as np

    logging.basicConfig(level=logging.INFO)
    stub_modules("torchdata", "cachetools")
    import verl  # noqa: F401  (runs verl's plugins, megatron_tree's among them)
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    pairs, uids = [], []
    g = torch.Generator().manual_seed(seed)
    for p in range(8):
        prompt = torch.randint(
            1, 1000, (int(torch.randint(8, 40, (1,), generator=g)),), generator=g
        )
        for _ in range(4):
            length = int(torch.randint(2, 24, (1,), generator=g))
            pairs.append((prompt, torch.randint(1, 1000, (length,), generator=g)))
            uids.append(f"prompt-{p}")
    padded, _ = rollout_layout(pairs)
    order = torch.randperm(len(pairs), generator=g)
    result = {"megatron_tree": bool(getattr(RayPPOTrainer._balance_batch, "megatron_tree", False))}
    for dp_size in dp_sizes:
        batch = DataProto.from_dict(
            {k: padded[k][order].clone() for k in ("input_ids", "attention_mask")},
            non_tensors={"uid": np.array(uids, dtype=object)[order.numpy()]},
        )
        trainer = types.SimpleNamespace(
            actor_rollout_wg=None, _get_dp_size=lambda wg, role, dp_size=dp_size: dp_size
        )
        RayPPOTrainer._balance_batch(trainer, batch, {})
        chunk = len(batch) // dp_size
        result[dp_size] = [
            sorted(set(batch.non_tensor_batch["uid"][r * chunk : (r + 1) * chunk]))
            for r in range(dp_size)
        ]
    return result
