"""Per-token losses and the weights that make a packed loss equal the unpacked batch's.

Everything here is in tree layout: tensors [T] aligned with a tree's ``token_index`` (its sequences
concatenated), with the tree's ``cu_seqlens`` [S + 1] marking the sequences.
"""

from __future__ import annotations

import torch

NORMALIZATIONS = ("token", "sequence")


def loss_weights(
    loss_mask: torch.Tensor, cu_seqlens: torch.Tensor, *, normalization: str = "token"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalized per-token weights of one tree and what they count.

    ``"token"``: the weight is the mask and the count is its sum, so ``sum(weight * loss) / count``
    is the token mean. ``"sequence"``: each sequence's mask divided by its own sum, and the count is
    the number of sequences with a nonzero mask (those without take no part), so the same ratio is
    the mean over sequences of each one's token mean. Dividing by the count summed over every tree
    (and every data-parallel rank) gives the loss of the unpacked global batch.

    Args:
        loss_mask: float [T] (fractional values allowed).
        cu_seqlens: int64 [S + 1].

    Returns:
        (weights float64 [T], count float64 scalar).
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r} must be one of {NORMALIZATIONS}")
    mask = loss_mask.to(torch.float64)
    if normalization == "token":
        return mask, mask.sum()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(mask.device)
    seq_of = torch.repeat_interleave(torch.arange(lengths.shape[0], device=mask.device), lengths)
    per_seq = torch.zeros(lengths.shape[0], dtype=torch.float64, device=mask.device).index_add_(
        0, seq_of, mask
    )
    has_loss = per_seq != 0
    return mask / torch.where(has_loss, per_seq, 1.0)[seq_of], has_loss.sum().to(torch.float64)


def per_token_input(
    micro_batch: dict, key: str, like: torch.Tensor, *, reader: str = "the loss"
) -> torch.Tensor:
    """``micro_batch[key]``, checked to be one value per token: shape [T], like ``like`` (a head
    output [T]). ValueError naming the key, the shape got and the fix, instead of a broadcast
    deep in the loss (a [T, 1] input times a [T] output is [T, T])."""
    if key not in micro_batch:
        raise ValueError(
            f"{reader} reads micro_batch[{key!r}], which the batch lacks: pass it in the padded "
            f"batch ([B, L]) or attach it (packed.attach({key!r}, values), [T] per micro-batch)"
        )
    value = micro_batch[key]
    if not isinstance(value, torch.Tensor) or value.shape != like.shape:
        tensor = isinstance(value, torch.Tensor)
        trailing = tensor and value.dim() > 1 and value.shape[:1] == like.shape[:1]
        fix = "pass one value per token"
        if trailing:
            fix = f"squeeze the trailing dim ({key}.squeeze(-1)) before packing or attaching"
        shape = tuple(value.shape) if tensor else type(value).__name__
        raise ValueError(
            f"{reader}: micro_batch[{key!r}] has shape {shape}, expected [T] = {tuple(like.shape)} "
            f"(one value per token: [B, L] in the padded batch, [T] in tree layout); {fix}"
        )
    return value


def ppo_clipped_loss(
    outputs: dict,
    micro_batch: dict,
    *,
    clip_eps: float = 0.2,
    entropy_coef: float = 0.0,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """PPO/GRPO clipped surrogate per token [T] (a shipped example of ``loss_fn``).

    Reads ``outputs["logprobs"]`` / ``outputs["entropy"]`` and the micro-batch's ``old_logprobs``
    and ``advantages`` [T], all in the rolled convention (entry t is about token t + 1). With
    ``kl_coef`` it adds ``kl_coef`` times the k3 estimate of KL(policy || reference),
    ``exp(r) - r - 1`` with ``r = ref_logprobs - logprobs`` (unbiased, >= 0), reading the
    micro-batch's ``ref_logprobs`` (a forward-only pass of the reference model, attached).
    """
    logprobs = outputs["logprobs"]

    def read(key):  # one value per token, like the log-probs
        return per_token_input(micro_batch, key, logprobs, reader="ppo_clipped_loss")

    old, adv = read("old_logprobs"), read("advantages")
    ratio = torch.exp(logprobs - old)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if entropy_coef:
        loss = loss - entropy_coef * outputs["entropy"]
    if kl_coef:
        if "ref_logprobs" not in micro_batch:
            raise ValueError(
                "kl_coef needs the reference log-probs: attach them as 'ref_logprobs' [T]"
            )
        log_ratio = read("ref_logprobs") - logprobs
        loss = loss + kl_coef * (torch.exp(log_ratio) - log_ratio - 1)
    return loss


def value_loss(outputs: dict, micro_batch: dict) -> torch.Tensor:
    """Squared error of the critic's values against ``returns`` per token [T] (halved)."""
    values = outputs["values"]
    returns = per_token_input(micro_batch, "returns", values, reader="value_loss")
    return 0.5 * (values - returns) ** 2
