"""A value head for Megatron GPT models, so a critic trains on packed trees like an actor.

:func:`attach_value_head` swaps the last pipeline stage's vocab-parallel ``output_layer`` for a
scalar head replicated on every tensor-parallel rank; the model then returns values [b, s, 1]
instead of logits, and :func:`megatron_tree.gather_packed_tree_values` reads them per sequence.
"""

from __future__ import annotations

import torch


class ValueHead(torch.nn.Linear):
    """hidden [s, b, H] -> values [s, b, 1], called the way GPTModel calls its ``output_layer``.

    Replicated across tensor-parallel ranks: its input (the final hidden states) is already
    complete on every rank, so each rank computes the full gradient and no collective is needed.
    """

    def __init__(self, hidden_size: int, *, bias: bool = True, dtype: torch.dtype | None = None):
        super().__init__(hidden_size, 1, bias=bias, dtype=dtype)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        return super().forward(hidden_states), None


def attach_value_head(model, *, bias: bool = True, init_std: float | None = None, seed: int = 1234):
    """Replace ``model.output_layer`` with a :class:`ValueHead` (in place); returns ``model``.

    Args:
        model: a GPTModel (e.g. ``TreeGPTModel``), possibly wrapped in Float16Module, whose
            embeddings and output weights are not tied. On pipeline stages without an output layer
            this is a no-op. Attach the head before wrapping the model in DDP, so that DDP's
            gradient buffers include it.
        bias: give the head a bias.
        init_std: normal init std of the head weight; default ``config.init_method_std``.
        seed: seed of the head's init, the same on every rank so the replicas agree.

    Raises:
        ValueError: not a GPTModel; tied embeddings; or sequence parallelism (the head expects full
            hidden states).
    """
    gpt = model
    while not hasattr(gpt, "post_process") and hasattr(gpt, "module"):  # Float16Module, DDP
        gpt = gpt.module
    if not hasattr(gpt, "post_process"):
        raise ValueError(
            f"attach_value_head needs a GPTModel (optionally wrapped), got {type(model).__name__}"
        )
    if not gpt.post_process:  # a pipeline stage without the output layer
        return model
    config = gpt.config
    if gpt.share_embeddings_and_output_weights:
        raise ValueError(
            "attach_value_head needs share_embeddings_and_output_weights=False (the value head "
            "replaces the output layer, which must not be the input embedding)"
        )
    if config.sequence_parallel:
        raise ValueError("attach_value_head does not support sequence_parallel=True; disable it")
    head = ValueHead(config.hidden_size, bias=bias, dtype=config.params_dtype)
    device = next(gpt.parameters()).device
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        std = config.init_method_std if init_std is None else init_std
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)
        if bias:
            head.bias.zero_()
    gpt.output_layer = head.to(device)
    return model
