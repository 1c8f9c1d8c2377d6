"""A value head for Megatron GPT models, so a critic trains on packed trees like an actor.

:func:`attach_value_head` swaps the last pipeline stage's vocab-parallel ``output_layer`` for a
scalar head replicated on every tensor-parallel rank; the model then returns values [b, s, 1]
instead of logits, and :func:`megatron_tree.gather_packed_tree_values` reads them per sequence.
Under sequence parallelism the head gathers the sequence-sharded hidden states first, as Megatron's
own output layer does, so every rank still returns the values of the whole sequence.

Legend: s sequence length (the packed tree length N), b micro-batch size, H hidden size, tp the
tensor-parallel size.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.utils import get_tensor_model_parallel_group_if_none


class ValueHead(torch.nn.Linear):
    """hidden [s, b, H] (or its sequence shard [s/tp, b, H]) -> values [s, b, 1], called the way
    GPTModel calls its ``output_layer``.

    Replicated across tensor-parallel ranks: its input (the final hidden states) is complete on
    every rank, so each rank computes the full output and the full weight gradient, and no gradient
    collective is needed.

    With ``sequence_parallel=True`` its input is the rank's shard of the sequence, [s/tp, b, H]
    (rank r holds rows r*s/tp .. (r+1)*s/tp - 1), as it is for Megatron's ``ColumnParallelLinear``
    output layer, which gathers its input along the sequence first; this head does the same with
    Megatron's ``gather_from_sequence_parallel_region``, so the result is still values [s, b, 1] for
    the whole sequence on every rank. Gradients:

    * weight and bias: every rank computes them from the whole gathered sequence and the same loss,
      so each rank already holds the full gradient. The parameters are therefore not marked
      ``sequence_parallel`` (``finalize_model_grads`` sums marked parameters over the TP group,
      which would count this gradient tp times); like any replicated non-tensor-parallel parameter
      they are reduced over data-parallel ranks only.
    * input: everything after the gather is computed identically on every rank (not split over
      ranks as a vocab-parallel output layer is), so the gradient of the gathered hidden states is
      the same on every rank and the shard's gradient is just its own rows. That is
      ``tensor_parallel_output_grad=False`` (backward: split), not the default reduce-scatter, which
      would add up tp identical copies.

    Gathering the values [s/tp, b, 1] instead of the hidden states would move 1/H of the data but
    leave each rank with the weight gradient of its own tokens only; that would need the parameters
    marked ``sequence_parallel`` and ``finalize_model_grads`` (or the caller) to sum them.

    Args:
        hidden_size: H.
        bias: give the head a bias.
        dtype: parameter dtype.
        sequence_parallel: the input is sequence-sharded over ``tp_group``. GPTModel may switch this
            attribute off for a forward (as it does for its own output layer in dynamic inference).
        tp_group: the tensor-parallel group the sequence is sharded over; default Megatron's
            ``parallel_state`` group.
    """

    def __init__(
        self,
        hidden_size: int,
        *,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        sequence_parallel: bool = False,
        tp_group: torch.distributed.ProcessGroup | None = None,
    ):
        super().__init__(hidden_size, 1, bias=bias, dtype=dtype)
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        """hidden [s, b, H] ([s/tp, b, H] under sequence parallelism) -> (values [s, b, 1],
        None)."""
        if self.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
            )  # [s, b, H]
        return super().forward(hidden_states), None


def attach_value_head(model, *, bias: bool = True, init_std: float | None = None, seed: int = 1234):
    """Replace ``model.output_layer`` with a :class:`ValueHead` (in place); returns ``model``.

    Under sequence parallelism (``config.sequence_parallel`` with more than one tensor-parallel
    rank) the head takes the model's sequence-sharded final hidden states [s/tp, b, H] and gathers
    them over the model's tensor-parallel group, so the model still returns values [b, s, 1] for the
    whole sequence on every rank (see :class:`ValueHead` for why its gradients need no TP
    reduction).

    Args:
        model: a GPTModel (e.g. ``TreeGPTModel``), possibly wrapped in Float16Module, whose
            embeddings and output weights are not tied. On pipeline stages without an output layer
            this is a no-op. Attach the head before wrapping the model in DDP, so that DDP's
            gradient buffers include it.
        bias: give the head a bias.
        init_std: normal init std of the head weight; default ``config.init_method_std``.
        seed: seed of the head's init, the same on every rank so the replicas agree.

    Raises:
        ValueError: not a GPTModel; or tied embeddings.
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
    tp_group = getattr(getattr(gpt, "pg_collection", None), "tp", None)  # the model's own group
    if tp_group is None:
        tp_group = get_tensor_model_parallel_group_if_none(None)
    sequence_parallel = bool(config.sequence_parallel) and tp_group.size() > 1
    head = ValueHead(
        config.hidden_size,
        bias=bias,
        dtype=config.params_dtype,
        sequence_parallel=sequence_parallel,
        tp_group=tp_group,
    )
    device = next(gpt.parameters()).device
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        std = config.init_method_std if init_std is None else init_std
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * std)
        if bias:
            head.bias.zero_()
    gpt.output_layer = head.to(device)
    return model
