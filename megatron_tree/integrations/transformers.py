"""HuggingFace causal LMs on packed trees, through transformers' attention interface.

The Megatron path's counterpart for HF models (under FSDP2, TRL, verl's FSDP engine, AReaL's FSDP
engine): the same packing, mask, attention backends and gathers of :mod:`megatron_tree.core`, with
transformers' own model code around them. Nothing of transformers is patched:

* :func:`register_tree_attention` registers :func:`tree_attention_forward` in transformers'
  ``AttentionInterface`` under ``ATTENTION_KEY``; the key is not registered as a mask function, so
  HF builds no mask (and does not read drops in ``position_ids`` as document starts) and the tree
  mask rides in the forward's keyword arguments (``tree_mask``), which HF hands every attention
  call (also when gradient checkpointing recomputes a layer).
* :func:`prepare_model` selects that implementation on a model, swaps the recurrent mixers that
  have no interface hook (gated delta-nets, Mamba-2) for tree modules over
  :mod:`megatron_tree.core.recurrent`, and refuses families it cannot run by name.
* :func:`tree_forward` runs one micro-batch (ids [1, n], depth ``position_ids``: HF's rotary reads
  them directly) and returns the model's output; :func:`packed_logprobs` runs a packed batch and
  gives per-sequence log-probs / entropy / values back in the caller's layout (padded, ragged, THD);
  :func:`head_forward` (the forward and a core head, :mod:`megatron_tree.core.heads`, on its
  output) is its step, and the FSDP engines' (verl, AReaL) per micro-batch.

HF's dtype handling, gradient checkpointing and ``torch.compile`` stay as they are. Legend: N a
tree's packed length, n the rows of a micro-batch here, B batch size, L the longest sequence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..core.attention import BACKENDS, tree_attention
from ..core.batch import MicroBatch, PackedTreeBatch, micro_batch
from ..core.finite import FiniteCheck
from ..core.heads import LogProbs, Values
from ..core.mask import TreeMask, tree_attention_mask
from ..core.results import merge_packed_tree_results

ATTENTION_KEY = "megatron_tree"

logger = logging.getLogger(__name__)

# HF model types the tests run against the same model on each sequence alone (README models table).
TESTED_MODEL_TYPES = (
    "qwen2",
    "qwen3",
    "llama",
    "qwen3_moe",
    "qwen2_moe",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_text",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "nemotron_h",
)

# Module class names whose state runs along the sequence (no attention-interface hook): they must
# be swapped for a tree module (:mod:`.transformers_recurrent`) or the model is refused. "Mixer":
# Bamba's and Falcon-H1's Mamba-2 mixers (BambaMixer, FalconH1Mixer) have no "Mamba" in the name.
_RECURRENT_MARKERS = (
    "Mamba",
    "Mixer",
    "GatedDeltaNet",
    "LinearAttention",
    "Rwkv",
    "ShortConv",
    "Lightning",
)


@dataclass(frozen=True)
class TreeAttentionOptions:
    """How :func:`tree_attention_forward` runs a model's layers (``tree_attention`` arguments).

    Attributes:
        backend: one of ``core.attention.BACKENDS`` ("auto": flex on CUDA, causal for micro-batches
            that share nothing, block-sparse on the CPU).
        block_size: the tile size of the flex / block-sparse / triton backends.
    """

    backend: str = "auto"
    block_size: int = 128

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} is not one of {BACKENDS}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    tree_mask: TreeMask | None = None,
    tree_options: TreeAttentionOptions | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the core's ``tree_attention``.

    Args:
        module: the HF attention module (its ``layer_idx`` keys a trunk part's stored keys).
        query: [b, np, n, hn]; key [b, ng, K, hn]; value [b, ng, K, hv] (rotary applied by HF).
        attention_mask: must be None (HF builds no mask for this key).
        scaling: softmax scale (HF's ``module.scaling``).
        dropout: attention dropout probability (0 in eval).
        tree_mask: the micro-batch's :func:`~megatron_tree.core.mask.tree_attention_mask`.
        tree_options: backend and tile size (:class:`TreeAttentionOptions`).
        sliding_window: HF's window W (a query sees the W - 1 tokens above it, over depth).
        s_aux: gpt-oss's per-head sink logits [np].

    Returns:
        ([b, n, np, hv], None): HF's output layout; no attention weights.
    """
    if tree_mask is None:
        raise ValueError(
            f"attn_implementation={ATTENTION_KEY!r} needs the tree mask in the forward's kwargs: "
            "run the model through megatron_tree.integrations.transformers.tree_forward (or pass "
            "tree_mask=tree_attention_mask(micro_batch.rows))"
        )
    if attention_mask is not None:
        raise ValueError(
            f"attn_implementation={ATTENTION_KEY!r} got an attention_mask from HF: call the model "
            "without attention_mask (the tree mask replaces it)"
        )
    options = tree_options or TreeAttentionOptions()
    # [b, h, n, d] -> Megatron's [n, b, h, d]
    q, k, v = (t.permute(2, 0, 1, 3) for t in (query, key, value))
    k, v = tree_mask.plan.keys_values(k, v, getattr(module, "layer_idx", 0))
    window = None if sliding_window is None else (int(sliding_window) - 1, 0)
    out = tree_attention(
        q,
        k,
        v,
        tree_mask,
        backend=options.backend,
        softmax_scale=scaling,
        dropout_p=dropout,
        block_size=options.block_size,
        window_size=window,
        softmax_offset=None if s_aux is None else s_aux.float(),
    )
    n, b, num_heads = q.shape[0], q.shape[1], q.shape[2]
    return out.view(n, b, num_heads, value.shape[-1]).transpose(0, 1), None


def register_tree_attention(key: str = ATTENTION_KEY) -> str:
    """Register :func:`tree_attention_forward` in transformers' ``AttentionInterface`` under
    ``key`` (idempotent) and return the key, for ``attn_implementation=key``."""
    from transformers import AttentionInterface

    AttentionInterface.register(key, tree_attention_forward)
    return key


def _recurrent_modules(model: torch.nn.Module) -> list[str]:
    return sorted(
        {
            type(m).__name__
            for m in model.modules()
            if any(marker in type(m).__name__ for marker in _RECURRENT_MARKERS)
            and not getattr(m, "is_tree_module", False)
        }
    )


def prepare_model(model: torch.nn.Module, *, key: str = ATTENTION_KEY) -> torch.nn.Module:
    """Make an HF causal LM run packed trees: select the tree attention, swap recurrent mixers.

    Idempotent; returns ``model`` (changed in place). Call it before wrapping the model (FSDP2's
    ``fully_shard``, ``torch.compile``): the swapped mixers keep the parameters (same names and
    tensors), so checkpoints and optimizers see the same model.

    Raises:
        ValueError: a model whose modeling code does not use the attention interface, or one with
            recurrent mixers that have no tree module (named in the message).
    """
    from .transformers_recurrent import swap_recurrent_modules

    register_tree_attention(key)
    config = model.config
    if getattr(config, "_attn_implementation", None) != key:
        try:
            model.set_attn_implementation(key)
        except (AttributeError, ValueError) as error:
            raise ValueError(
                f"{type(model).__name__} ({config.model_type}) cannot take attn_implementation="
                f"{key!r}: its modeling code does not use transformers' attention interface "
                f"({error})"
            ) from error
        if config._attn_implementation != key:  # some transformers versions only warn
            raise ValueError(
                f"{type(model).__name__} ({config.model_type}) cannot take attn_implementation="
                f"{key!r}: its modeling code does not use transformers' attention interface "
                f"(it kept {config._attn_implementation!r})"
            )
    if config.model_type not in TESTED_MODEL_TYPES:
        logger.warning(
            "prepare_model: %s is not among the HF families tested against HF on each sequence "
            "(%s); check its log-probs against an unpacked run before training",
            config.model_type,
            ", ".join(TESTED_MODEL_TYPES),
        )
    swap_recurrent_modules(model)
    left = _recurrent_modules(model)
    if left:
        raise ValueError(
            f"{type(model).__name__} ({config.model_type}) has recurrent mixers {left} with no "
            "tree module: a packed tree would run them across branches. Tree modules exist for "
            "gated delta-nets (Qwen3.5, Qwen3-Next) and Mamba-2 (Nemotron-H)"
        )
    return model


def _check_model(model: torch.nn.Module, key: str) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != key:
        raise ValueError(
            f"the model runs attn_implementation={impl!r}: call "
            f"megatron_tree.integrations.transformers.prepare_model(model) first"
        )


def tree_forward(
    model: torch.nn.Module,
    mb: MicroBatch,
    *,
    options: TreeAttentionOptions | None = None,
    key: str = ATTENTION_KEY,
    **model_kwargs: Any,
):
    """One packed micro-batch through an HF model prepared by :func:`prepare_model`.

    Args:
        model: the HF model (a causal LM, or a token-classification / value model), possibly
            wrapped (FSDP2, DDP, torch.compile: the config is read from ``model.config`` or the
            wrapped module's).
        mb: a micro-batch of a :class:`~megatron_tree.core.batch.PackedTreeBatch` (or a
            :class:`~megatron_tree.core.tree.PackedTree`): ids [1, n], depths [1, n].
        options: backend and tile size of the tree attention.
        model_kwargs: passed to the model (e.g. ``logits_to_keep``); never ``attention_mask``.

    Returns:
        the model's output (``.logits`` [1, n, V] for a causal LM).
    """
    if not isinstance(mb, MicroBatch):
        mb = micro_batch(mb)
    for name in ("attention_mask", "input_ids", "position_ids", "tree_mask"):
        if name in model_kwargs:
            raise ValueError(f"tree_forward sets {name} itself; do not pass it")
    inner = getattr(model, "module", model)
    _check_model(inner if hasattr(inner, "config") else model, key)
    return model(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        tree_mask=tree_attention_mask(mb.rows),
        tree_options=options or TreeAttentionOptions(),
        use_cache=False,
        **model_kwargs,
    )


def head_forward(
    model: torch.nn.Module,
    mb: MicroBatch,
    head,
    *,
    options: TreeAttentionOptions | None = None,
    key: str = ATTENTION_KEY,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One micro-batch through the model (:func:`tree_forward`) and a core head on its output.

    Args:
        model: prepared by :func:`prepare_model` (possibly wrapped).
        mb: a whole-tree micro-batch (ids [1, n]).
        head: a core head (:class:`~megatron_tree.core.heads.LogProbs`, ``Values``, or one with
            their ``gather(output, tree, tp_group, rows)``), run without tensor parallelism.

    Returns:
        (the model's output [n, V] (logits; a value model's [n, 1]), the head's per-token outputs
        {name: [T]} in tree order). A data-parallel fill-in (an all-padding tree) gives empty
        outputs [0]; its caller takes ``output.sum() * 0`` as its loss, so that FSDP's collectives
        and gradient reductions run alike on every rank.
    """
    output = tree_forward(model, mb, options=options, key=key)
    output = output.logits if hasattr(output, "logits") else output
    output = output.reshape(-1, output.shape[-1])
    return output, head.gather(output, mb.tree, None)


@dataclass
class PackedOutputs:
    """Per-sequence results of :func:`packed_logprobs`, in the layout the batch was given in.

    Attributes:
        logprobs: [B, L] (or the batch's ragged layout); entry t of a sequence is log p(token t+1 |
            tokens <= t), its last entry 0. Differentiable.
        entropy: the same layout (entry t: the entropy at token t), or None when not asked for.
        values: a value model's per-token values in the same layout, or None.
    """

    logprobs: Any = None
    entropy: Any = None
    values: Any = None


def packed_logprobs(
    model: torch.nn.Module,
    batch: PackedTreeBatch,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    values: bool = False,
    options: TreeAttentionOptions | None = None,
    key: str = ATTENTION_KEY,
) -> PackedOutputs:
    """Run every micro-batch of ``batch`` and read per-sequence results in the caller's layout.

    Args:
        model: prepared by :func:`prepare_model`.
        batch: from :func:`~megatron_tree.core.packing.build_packed_tree_batch`, on the model's
            device (``batch.to(device)``); whole trees (pack with ``share_trunks=False``).
        temperature: logits are divided by it (log-probs and entropy).
        entropy: also read the entropy at every token.
        values: read a value model's output ([1, n, 1] ``logits``) as values instead of log-probs.

    Returns:
        :class:`PackedOutputs`; each field [B, L] or the batch's input layout. Differentiable: a
        loss on them backpropagates through every micro-batch (their graphs are all kept until
        then; call per micro-batch batch for less memory).

    Raises:
        NonFiniteOutputError: a NaN or inf output, naming the micro-batch and the batch rows (one
            host read of one flag per micro-batch, after the last forward).
    """
    if values and entropy:
        raise ValueError("values=True reads a value model: entropy=True does not apply")
    head = Values() if values else LogProbs(temperature=temperature, entropy=entropy)
    merged = {name: [] for name in head.outputs}
    finite = FiniteCheck("packed_logprobs")
    for i, mb in enumerate(batch):
        if not mb.rows.is_whole:
            raise ValueError(
                "the HF engine runs whole trees, but this batch was packed with trunk reuse or "
                "context parallelism: pack it with share_trunks=False (trunk reuse runs on the "
                "Megatron path's phase schedule only)"
            )
        per_token = head_forward(model, mb, head, options=options, key=key)[1]
        finite.add(i, mb.tree, per_token)
        for name, tensor in per_token.items():
            merged[name].append((tensor, mb.tree))
    finite.raise_if_any()  # one host read: no NaN / inf is returned
    return PackedOutputs(
        **{
            name: batch.input_layout.restore(merge_packed_tree_results(pairs, batch.batch_size))
            for name, pairs in merged.items()
            if pairs
        }
    )
