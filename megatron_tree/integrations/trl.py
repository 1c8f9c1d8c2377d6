"""TRL's ``GRPOTrainer`` on packed trees: the per-token log-probs of a prompt group run once per
shared token.

:class:`TreeGRPOTrainer` is TRL 1.16's ``GRPOTrainer`` with one method replaced,
``_get_per_token_logps_and_entropies`` (the policy's log-probs and entropies in the loss, the old
and reference log-probs after generation): the batch's rows (left-padded prompt + right-padded
completion) are packed into prefix tries (a prompt's ``num_generations`` completions share the
prompt and every common prefix), the model runs them through the tree attention
(:mod:`.transformers`) and the results come back in TRL's layout, so TRL's losses, metrics and data
handling run unchanged. The tree attention stays selected on the policy (and reference) model, also
while gradient checkpointing recomputes a layer in the backward; generation (``_generate``)
switches back to the model's own attention for its duration.

Legend: B rows, T prompt + completion columns, C completion columns (``logits_to_keep``), L the
longest real (unpadded) row.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from trl import GRPOTrainer

from ..core.packing import build_packed_tree_batch
from .transformers import (
    ATTENTION_KEY,
    TreeAttentionOptions,
    packed_logprobs,
    prepare_model,
)

__all__ = [
    "TreeGRPOTrainer",
    "check_capacity",
    "completion_logprobs",
    "tree_attention_selected",
]


@contextmanager
def attention_selected(models: list[torch.nn.Module], key: str):
    """Select attention implementation ``key`` on (unwrapped) HF models for the block, then restore
    each model's previous one."""
    previous = [m.config._attn_implementation for m in models]
    for model in models:
        model.set_attn_implementation(key)
    try:
        yield
    finally:
        for model, impl in zip(models, previous):
            model.set_attn_implementation(impl)


@contextmanager
def tree_attention_selected(model: torch.nn.Module, *, key: str = ATTENTION_KEY):
    """``prepare_model`` on an (unwrapped) HF model for the block, then its own attention again.
    Only for forwards whose backward also ends inside the block (gradient checkpointing recomputes
    layers with the implementation selected at backward time)."""
    previous = model.config._attn_implementation
    prepare_model(model, key=key)
    try:
        yield model
    finally:
        if previous != key:
            model.set_attn_implementation(previous)


def completion_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    max_tokens_per_mb: int | None = None,
    options: TreeAttentionOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of the completion columns, the rows run as prefix tries.

    Args:
        model: an HF causal LM with the tree attention selected (:func:`tree_attention_selected`),
            possibly wrapped (DDP, FSDP2).
        input_ids: [B, T] prompt (left-padded) then completion (right-padded) columns.
        attention_mask: [B, T] 1 on real tokens; each row's ones must be one contiguous run that
            starts in the prompt columns.
        logits_to_keep: C, the completion columns (the last C of T).
        temperature: the logits are divided by it.
        entropy: also return the entropy of each completion token's distribution.
        max_tokens_per_mb: unique-token capacity of one micro-batch (a multiple of
            ``options.block_size``); None: the whole batch in one (rounded up).
        options: tree attention backend and tile size (also the packing alignment).

    Returns:
        (logps [B, C], entropies [B, C] or None): entry [b, j] is log p(completion token j |
        everything before it) (TRL's shift), 0 where ``attention_mask`` is 0. Differentiable.
    """
    options = options or TreeAttentionOptions()
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids must be [B, T] and attention_mask the same shape, got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    num_rows, num_cols = input_ids.shape
    if not 0 < logits_to_keep < num_cols:
        raise ValueError(
            f"logits_to_keep={logits_to_keep} must be in [1, T - 1] (T = {num_cols}): at least "
            "one prompt column must precede the completion"
        )
    mask = attention_mask.detach().to("cpu", torch.bool)  # one host copy for the packing plan
    counts = mask.sum(1)  # [B]
    first = mask.int().argmax(1)  # [B] first real column
    cols = torch.arange(num_cols)
    run = (cols >= first[:, None]) & (cols < (first + counts)[:, None])
    if not torch.equal(run, mask):
        raise ValueError(
            "attention_mask: every row's real tokens must be one contiguous run (left-padded "
            "prompt, right-padded completion); a row with holes has no prefix-tree layout"
        )
    prompt_cols = num_cols - logits_to_keep
    if bool((counts == 0).any()) or bool((first >= prompt_cols).any()):
        raise ValueError(
            "attention_mask: every row needs at least one real prompt token before its completion "
            f"(the first {prompt_cols} columns): the first completion token is scored from it"
        )
    # Rows compacted to the left ([B, L], right-padded), the layout build_packed_tree_batch reads.
    longest = int(counts.max())
    src = (torch.arange(longest)[None] + first[:, None]).clamp(max=num_cols - 1)  # [B, L]
    compact_ids = input_ids.detach().cpu().gather(1, src)
    compact_mask = torch.arange(longest)[None] < counts[:, None]
    if max_tokens_per_mb is None:
        align = options.block_size
        max_tokens_per_mb = max(-(-int(counts.sum()) // align), 1) * align
    batch = build_packed_tree_batch(
        {"input_ids": compact_ids * compact_mask, "attention_mask": compact_mask.long()},
        max_tokens_per_mb=max_tokens_per_mb,
        block_size=options.block_size,
        share_trunks=False,
    ).to(input_ids.device)
    out = packed_logprobs(model, batch, temperature=temperature, entropy=entropy, options=options)
    # Completion column j of row b sits at compact index T - C + j - first_b; its log-prob is the
    # entry before it (entry t scores token t + 1).
    j = torch.arange(logits_to_keep)[None]
    index = (prompt_cols - 1 - first[:, None] + j).clamp(min=0, max=longest - 1)  # [B, C]
    index = index.to(input_ids.device)
    valid = attention_mask[:, prompt_cols:].bool()

    def completion_part(per_token: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, per_token.gather(1, index), 0.0)

    logps = completion_part(out.logprobs)
    return logps, completion_part(out.entropy) if entropy else None


def check_capacity(
    tree_max_tokens_per_mb: int | None, *, num_processes: int, sharded: bool
) -> None:
    """Refuse a micro-batch capacity where the parameters are sharded over several processes
    (FSDP, DeepSpeed ZeRO-3): every forward gathers them on all ranks, and the ranks may pack their
    rows into different numbers of micro-batches. (DDP reduces once per backward: uneven forwards
    are fine there.)"""
    if tree_max_tokens_per_mb is not None and sharded and num_processes > 1:
        raise ValueError(
            f"tree_max_tokens_per_mb={tree_max_tokens_per_mb} with parameters sharded over "
            f"{num_processes} processes (FSDP / DeepSpeed ZeRO-3): every rank must run as many "
            "forwards; leave tree_max_tokens_per_mb=None (one micro-batch per call)"
        )


class TreeGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` whose per-token log-probs and entropies run on packed prefix trees.

    A drop-in for ``GRPOTrainer`` (same arguments) with two keyword-only additions:

    Args:
        tree_max_tokens_per_mb: unique-token capacity of one packed micro-batch (a multiple of
            ``tree_options.block_size``); None: a whole log-prob batch in one micro-batch, as TRL
            runs it (required where FSDP / DeepSpeed ZeRO-3 shard the parameters over several
            processes: every rank must run as many forwards). The logits of a micro-batch are
            materialized ([n, V]).
        tree_options: the tree attention's backend and tile size.

    The policy (and reference) model run the tree attention from construction on
    (:func:`~megatron_tree.integrations.transformers.prepare_model`); ``_generate`` selects the
    model's own implementation while it runs. Refused (``ValueError`` at the first log-prob call):
    multimodal inputs, MoE auxiliary losses (``output_router_logits``), and attention masks whose
    rows are not one contiguous run.
    """

    def __init__(
        self,
        *args: Any,
        tree_max_tokens_per_mb: int | None = None,
        tree_options: TreeAttentionOptions | None = None,
        **kwargs: Any,
    ):
        self.tree_options = tree_options or TreeAttentionOptions()
        if tree_max_tokens_per_mb is not None and (
            not isinstance(tree_max_tokens_per_mb, int)
            or tree_max_tokens_per_mb <= 0
            or tree_max_tokens_per_mb % self.tree_options.block_size
        ):
            raise ValueError(
                f"tree_max_tokens_per_mb={tree_max_tokens_per_mb!r} must be None or a positive "
                f"multiple of tree_options.block_size={self.tree_options.block_size}"
            )
        self.tree_max_tokens_per_mb = tree_max_tokens_per_mb
        super().__init__(*args, **kwargs)
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        check_capacity(
            tree_max_tokens_per_mb,
            num_processes=self.accelerator.num_processes,
            sharded=bool(self.is_fsdp_enabled or is_deepspeed_zero3_enabled()),
        )
        models = [self._hf_model(self.model)]
        if self.ref_model is not None:
            models.append(self._hf_model(self.ref_model))
        # The implementation generation runs with (sdpa, flash-attention, ...).
        self.generation_attention = models[0].config._attn_implementation
        for model in models:
            prepare_model(model)

    def _hf_model(self, model: torch.nn.Module) -> torch.nn.Module:
        inner = self.accelerator.unwrap_model(model)
        return inner.get_base_model() if hasattr(inner, "get_base_model") else inner

    def _generate(self, prompts: list):
        """TRL's generation, with the model's own attention selected for its duration."""
        with attention_selected([self._hf_model(self.model)], self.generation_attention):
            return super()._generate(prompts)

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **extra_inputs,
    ):
        """TRL's signature and result: (logps [B, C], entropies [B, C] or None, None). The rows run
        as prefix trees in micro-batches of ``tree_max_tokens_per_mb`` (``batch_size`` is TRL's row
        chunking, not used)."""
        given = sorted(name for name, value in extra_inputs.items() if value is not None)
        if given:
            raise ValueError(
                f"TreeGRPOTrainer runs text-only batches, got {given}: use trl.GRPOTrainer for "
                "multimodal models"
            )
        if compute_aux_loss:
            raise ValueError(
                "TreeGRPOTrainer does not compute the MoE load-balancing loss: set the model "
                "config's output_router_logits=False (or use trl.GRPOTrainer)"
            )
        with self.accelerator.autocast():
            logps, entropies = completion_logprobs(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                temperature=self.temperature,
                entropy=compute_entropy,
                max_tokens_per_mb=self.tree_max_tokens_per_mb,
                options=self.tree_options,
            )
        return logps, entropies, None
