"""The unpacked reference for a tree step: every sequence alone through a stock Megatron GPTModel.

Used by the tests and by ``scripts/torchrun_parity.py`` to check, on any parallel layout, that
:func:`megatron_tree.tree_forward_backward` gives the loss and gradients of the unpacked batch. The
reference shares no code with the tree path: causal attention over positions 0..L-1, full-vocab
float64 log-softmax on the gathered logits, the loss normalization written out here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


def unpacked_reference_step(
    model,
    batch: dict[str, torch.Tensor],
    loss_fn: Callable[[dict, dict], torch.Tensor],
    *,
    critic: bool = False,
    backward: bool = True,
    outputs: dict[int, dict[str, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Token-mean loss of ``batch``, one sequence at a time, and its backward.

    Args:
        model: a stock Megatron GPTModel (causal attention) holding the whole model (no pipeline
            split), vocab-parallel over the current tensor-parallel group; or a value model.
        batch: as for ``tree_forward_backward``; ``loss_mask`` [B, L] required.
        loss_fn: the per-token loss, called per sequence with [L] tensors.
        critic: the model returns values [1, L, 1] instead of logits.
        backward: accumulate gradients.
        outputs: if given, filled with each sequence's detached outputs ({"logprobs", "entropy"} or
            {"values"}, [L] each; log-probs rolled, 0 at the last entry), by batch index.

    Returns:
        The loss (fp32 scalar, detached).
    """
    from megatron.core import tensor_parallel

    lengths = batch["attention_mask"].sum(1).tolist()
    device = next(model.parameters()).device
    if backward:
        # The MoE router losses' gradient scale, as Megatron's schedule sets it (size 1; Megatron
        # keeps the first tensor and copies later scales into it).
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1, device=device))
    per_token_keys = [k for k in batch if k not in ("input_ids", "attention_mask")]
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i, n in enumerate(lengths):
        seq = batch["input_ids"][i, :n].to(device)
        row = {k: batch[k][i, :n].to(device) for k in per_token_keys}
        out = model(seq[None], torch.arange(n, device=device)[None], attention_mask=None)
        if critic:
            per_token = {"values": out[0, :, 0].float()}
        else:
            full = tensor_parallel.gather_from_tensor_model_parallel_region(out)[0]  # [L, V]
            logp = torch.log_softmax(full.double(), dim=-1)
            logprobs = torch.zeros(n, dtype=torch.float64, device=device)
            logprobs[:-1] = logp[torch.arange(n - 1, device=device), seq[1:]]
            per_token = {"logprobs": logprobs, "entropy": -(logp.exp() * logp).sum(-1)}
        total = total + (loss_fn(per_token, row).double() * row["loss_mask"]).sum()
        if outputs is not None:
            outputs[i] = {k: v.detach() for k, v in per_token.items()}
    loss = total / (batch["loss_mask"] * batch["attention_mask"]).sum().to(device)
    if backward:
        loss.backward()
    return loss.detach().float()


class CausalCoreAttention(torch.nn.Module):
    """Reference core attention for Megatron layers on one unpacked sequence: causal softmax
    attention written out (scores, upper triangle to -inf, fp32 softmax, weighted values), with
    Megatron's core-attention constructor and forward protocol.

    Megatron-Core's local ``DotProductAttention`` does not take the ``k_channels`` / ``v_channels``
    that multi-latent attention passes (only transformer-engine's attention does), so a stock MLA
    model needs this to run on a CPU. query [s, b, np, hn], key [s, b, ng, hn], value [s, b, ng, hv]
    -> [s, b, np * hv].
    """

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type="self",
        attention_dropout=None,
        softmax_scale=None,
        k_channels=None,
        v_channels=None,
        cp_comm_type=None,
        pg_collection=None,
    ):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **unused,
    ):
        s, b, heads, dim = query.shape
        repeat = heads // key.shape[2]
        key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
        scale = dim**-0.5 if self.softmax_scale is None else self.softmax_scale
        scores = torch.einsum("qbhd,kbhd->bhqk", query.float(), key.float()) * scale
        future = torch.ones(s, s, dtype=torch.bool, device=query.device).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1).to(value.dtype)
        return torch.einsum("bhqk,kbhd->qbhd", probs, value).reshape(s, b, -1)


def stage_parameter_name(name: str, first_layer: int) -> str:
    """A pipeline stage's parameter name in the unsplit model (``decoder.layers.j`` -> ``j +
    first``)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + first_layer)
    return ".".join(parts)


def parameter_grads(
    model, *, prefix: str = "", main_grad: bool = False, require_all: bool = False
) -> dict[str, torch.Tensor]:
    """Detached copies of ``model``'s parameter gradients by name, for :func:`gradient_errors`.

    Args:
        model: any ``torch.nn.Module``.
        prefix: removed from the front of each name (e.g. ``"model."`` of a wrapper).
        main_grad: read Megatron DDP's ``main_grad`` buffers instead of ``.grad`` (verl zeroes them
            on leaving ``engine.train_mode()``: read them inside it).
        require_all: every parameter must have a gradient (else ``ValueError``); by default the
            parameters without one (``None``) are left out.
    """
    attr = "main_grad" if main_grad else "grad"
    grads = {}
    for name, param in model.named_parameters():
        grad = getattr(param, attr, None)
        if grad is None and require_all:
            raise ValueError(f"parameter {name} has no {attr}")
        if grad is not None:
            grads[name.removeprefix(prefix)] = grad.detach().clone()
    return grads


def gradient_errors(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Relative error ``|got - want| / |want|`` per parameter (names must match); ``inf`` where
    either gradient holds a NaN or inf (:func:`~megatron_tree.testing.tolerances.relative_error`),
    so that ``max()`` over the errors cannot drop it."""
    from megatron_tree.testing.tolerances import relative_error

    if got.keys() != want.keys():
        raise ValueError(
            f"gradient names differ: only in got {sorted(got.keys() - want.keys())[:4]}, only in "
            f"want {sorted(want.keys() - got.keys())[:4]}"
        )
    return {name: relative_error(got[name], want[name]) for name in want}


def finalize_sequence_parallel_grads(model) -> None:
    """Megatron's TP reduction of ``finalize_model_grads`` on a model without DDP.

    ``_allreduce_non_tensor_model_parallel_grads`` sums ``param.grad`` (no ``main_grad`` without
    DDP) over the TP group for parameters marked ``sequence_parallel``; it only reads
    ``ddp_config.use_megatron_fsdp`` from the DDP wrapper, which the stand-in provides.
    """
    import types

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    ddp_like = types.SimpleNamespace(module=model, ddp_config=DistributedDataParallelConfig())
    _allreduce_non_tensor_model_parallel_grads(
        [ddp_like], model.config, ps.get_tensor_model_parallel_group()
    )


@contextlib.contextmanager
def one_mamba_chunk(hf_model, length: int):
    """Run HuggingFace's Mamba-2 mixers of ``hf_model`` with one scan chunk of at least ``length``
    tokens while the block lasts (restored after).

    transformers' Nemotron-H ``torch_forward`` (5.12) sums the chunk-to-chunk state recurrence over
    the wrong axis (the target chunk instead of the source chunk), so its outputs past the first
    ``chunk_size`` tokens are off (9e-4 on a float64 mixer at 33 tokens with chunk 16, measured
    against the token-by-token recurrence); within one chunk it is exact (4e-8: its fp32 cast).
    A reference run inside this block is the exact Mamba-2 computation. Models without such mixers
    (``*Mamba2Mixer``) are left as they are."""
    mixers = [m for m in hf_model.modules() if type(m).__name__.endswith("Mamba2Mixer")]
    saved = [m.chunk_size for m in mixers]
    for m in mixers:
        m.chunk_size = max(m.chunk_size, length)
    try:
        yield
    finally:
        for m, chunk in zip(mixers, saved):
            m.chunk_size = chunk


class OneSequence(torch.nn.Module):
    """A tree model on one sequence at a time (a one-chain tree), with the stock call signature
    ``model(input_ids [1, L], position_ids, attention_mask=None)`` that
    :func:`unpacked_reference_step` uses: the unpacked reference for models whose stock token mixers
    cannot run here (Megatron's gated delta-net and Mamba mixers call GPU-only kernels). On a
    chain the tree layers do what the stock ones do (a causal convolution, a scan from zero)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask=None):
        from ..core.mask import tree_attention_mask
        from ..core.packing import build_packed_tree_batch

        n = input_ids.shape[1]
        batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        mb = build_packed_tree_batch(
            batch, max_tokens_per_mb=max(n, 1), block_size=1, pad_to_max=False, share_trunks=False
        )[0]
        out = self.model(
            mb["input_ids"], mb["position_ids"], attention_mask=tree_attention_mask(mb["tree"])
        )
        return out[:, :n]
