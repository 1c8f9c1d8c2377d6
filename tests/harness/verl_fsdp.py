"""verl 0.9.1's FSDP engine on a CPU-only machine, for tests: an engine builder (verl's stock engine
or megatron_tree's, chosen by ``VERL_ENGINE_VENDOR`` as on a GPU node).

The process-wide stand-ins are those of :mod:`harness.verl` that the FSDP engine needs
(a one-process gloo world, verl's platform on the CPU with the registry looked up for "cuda"); run
them in a spawned worker. None is needed by the adapter (:mod:`megatron_tree.integrations.
verl_fsdp`) on a GPU machine.
"""

from __future__ import annotations

import os

import torch

from .verl import give_pad_token, init_gloo_world, register_cpu_platform


def load_critic_with_sdpa(local_path, torch_dtype, model_config, trust_remote_code):
    """verl's critic loader (``verl.utils.model.load_valuehead_model``) hard-codes
    ``attn_implementation="flash_attention_2"``, which without flash-attention's package (always, on
    a CPU) raises ImportError; this loads the same token classifier with HF's ``sdpa``. For verl's
    stock critic only: the tree engine loads its critic with the tree attention itself."""
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        local_path,
        torch_dtype=torch_dtype,
        config=model_config,
        attn_implementation="sdpa",
        trust_remote_code=trust_remote_code,
    )


def setup_fsdp_cpu() -> None:
    """The stand-ins verl's FSDP engine needs on the CPU: the gloo world, verl's platform on the
    CPU (``VERL_ENGINE_DEVICE=cuda``: the registry is looked up as on a GPU node), and verl's
    critic loaded with ``sdpa`` (:func:`load_critic_with_sdpa`)."""
    from verl.utils import model

    init_gloo_world()
    register_cpu_platform()
    model.load_valuehead_model = load_critic_with_sdpa


def build_fsdp_engine(
    path: str,
    *,
    vendor: str | None,
    model_type: str = "language_model",
    strategy: str = "fsdp2",
    lr: float = 1e-3,
    clip_grad: float = 1.0,
    tree_max_tokens: int = 128,
    ulysses: int = 1,
    gradient_checkpointing: bool = True,
    lora_rank: int = 0,
):
    """verl's FSDP engine of ``model_type`` for the HF checkpoint at ``path``, chosen by
    ``VERL_ENGINE_VENDOR=vendor`` (None: verl's own), initialized: fp32 parameters and compute
    (``mixed_precision`` fp32, no autocast), no torch.compile, HF's ``sdpa`` attention for verl's
    engine (the tree engine selects its own). ``lr`` and ``clip_grad`` go to verl's optimizer (a
    ``clip_grad`` above the gradient norm leaves the gradients as the loss made them); the tree
    engine gets tiles of 16 tokens, the block-sparse backend and trees of ``tree_max_tokens``.
    ``ulysses``: verl's Ulysses size (the tree engine refuses > 1); ``gradient_checkpointing``:
    HF's, on by default as in verl; ``lora_rank``: verl's LoRA (peft) when > 0. A critic's score
    head (not in the checkpoint) is initialized from seed 0."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    if vendor:
        os.environ["VERL_ENGINE_VENDOR"] = vendor
    else:
        os.environ.pop("VERL_ENGINE_VENDOR", None)
    model_config = HFModelConfig(
        path=path,
        load_tokenizer=False,
        model_type=model_type,
        enable_gradient_checkpointing=gradient_checkpointing,
        lora_rank=lora_rank,
        override_config={"attn_implementation": "sdpa"},
    )
    give_pad_token(model_config)
    engine_config = FSDPEngineConfig(
        strategy=strategy,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=2,
        use_torch_compile=False,
        mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        ulysses_sequence_parallel_size=ulysses,
    )
    engine = EngineRegistry.new(
        model_type=model_type,
        backend=strategy,
        model_config=model_config,
        engine_config=engine_config,
        checkpoint_config=CheckpointConfig(),
        optimizer_config=FSDPOptimizerConfig(lr=lr, clip_grad=clip_grad, total_training_steps=10),
    )
    if vendor:
        engine.tree_block_size, engine.tree_max_tokens, engine.tree_backend = (
            16,
            tree_max_tokens,
            "block_sparse",
        )
    # A critic's head is not in a causal LM's checkpoint: HF initializes it from the global RNG.
    torch.manual_seed(0)
    engine.initialize()
    return engine, model_config
