"""What a tree step reads from a model's output: log-probs and entropy, or values.

A head object tells :func:`megatron_tree.tree_forward_backward` how to turn the last stage's output
tensor (this rank's rows under context parallelism) into per-token outputs [T] for the loss, and
which loss mask to use when the caller gives none. New heads (MoE statistics, several value heads,
...) are new classes, not new step flags.

Legend: N packed length, T the tree's sequence tokens, V vocabulary, tp tensor-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .checks import check_positive_number
from .logprobs import gather_packed_tree_logprobs, gather_packed_tree_logprobs_entropy
from .results import gather_packed_tree_values
from .rows import TreeRows
from .tree import PackedTree


@dataclass(frozen=True)
class LogProbs:
    """Rolled per-token log-probs (and entropy) from vocab-parallel logits [1, N, V / tp].

    Outputs: ``logprobs`` [T] (entry t of a sequence is log p(token t + 1 | tokens <= t), 0 at the
    last entry) and, with ``entropy=True``, ``entropy`` [T]. The loss mask is rolled the same way:
    a sequence's last entry predicts no token, so its default loss mask is every entry but the last,
    and a caller's mask with a nonzero last entry is rejected (it is usually an unrolled mask).
    """

    temperature: float = 1.0
    entropy: bool = True
    rolled = True

    @property
    def outputs(self) -> tuple[str, ...]:
        """The names of the per-token outputs it gives."""
        return ("logprobs", "entropy") if self.entropy else ("logprobs",)

    def __post_init__(self):
        object.__setattr__(
            self, "temperature", check_positive_number("temperature", self.temperature)
        )

    def check_output(
        self, output: torch.Tensor, tp_group: dist.ProcessGroup | None, max_token_id: int
    ) -> None:
        """Refuse an output that cannot hold logits over the batch's vocabulary (host shapes
        only)."""
        tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        width = output.shape[-1] * tp
        if output.shape[-1] == 1:
            raise ValueError(
                "LogProbs() reads vocab-parallel logits, but the model's output has width 1 (a "
                "value head?): pass gather=Values() for a critic"
            )
        if width <= max_token_id:
            raise ValueError(
                f"the logits cover {width} vocabulary entries ({output.shape[-1]} per rank x "
                f"tp={tp}) but the batch holds token id {max_token_id}: pass the model's "
                "tensor-parallel group as tp_group (None means Megatron's), or gather=Values() "
                "for a critic"
            )

    def gather(
        self,
        output: torch.Tensor,
        tree: PackedTree,
        tp_group: dist.ProcessGroup | None,
        rows: TreeRows | None = None,
    ) -> dict:
        kwargs = dict(temperature=self.temperature, tp_group=tp_group, rows=rows)
        if self.entropy:
            logprobs, entropy = gather_packed_tree_logprobs_entropy(output, tree, **kwargs)
            return {"logprobs": logprobs, "entropy": entropy}
        return {"logprobs": gather_packed_tree_logprobs(output, tree, **kwargs)}

    def default_loss_mask(self, tree: PackedTree) -> torch.Tensor:
        """float32 [T]: 1 everywhere except each sequence's last entry."""
        mask = torch.ones(
            tree.num_sequence_tokens, dtype=torch.float32, device=tree.token_index.device
        )
        mask[tree.cu_seqlens[1:] - 1] = 0
        return mask


@dataclass(frozen=True)
class Values:
    """A critic's per-token values from a value head's output [1, N, 1] (see ``attach_value_head``).

    Outputs: ``values`` [T] (entry t is the value at token t, not rolled). Default loss mask: every
    token.
    """

    rolled = False
    outputs = ("values",)

    def check_output(
        self, output: torch.Tensor, tp_group: dist.ProcessGroup | None, max_token_id: int
    ) -> None:
        """Refuse an output that is not one value per position."""
        if output.shape[-1] != 1:
            raise ValueError(
                "Values() reads a value head's output [1, N, 1], but the model's output has width "
                f"{output.shape[-1]} (logits?): attach a value head (attach_value_head) or use "
                "LogProbs()"
            )

    def gather(
        self,
        output: torch.Tensor,
        tree: PackedTree,
        tp_group: dist.ProcessGroup | None,
        rows: TreeRows | None = None,
    ) -> dict:
        return {"values": gather_packed_tree_values(output.float(), tree, rows=rows)}

    def default_loss_mask(self, tree: PackedTree) -> torch.Tensor:
        return torch.ones(
            tree.num_sequence_tokens, dtype=torch.float32, device=tree.token_index.device
        )
