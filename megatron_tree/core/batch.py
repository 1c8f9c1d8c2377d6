"""A packed rollout batch: its micro-batches (one tree each), per-token inputs in tree layout.

Pack a rollout batch once (:func:`megatron_tree.build_packed_tree_batch`), then attach what later
passes produce (old and reference log-probs, advantages, values) in tree layout and step on it as
often as needed; nothing goes back through [B, L].

Legend: B batch size, L padded sequence length, N packed tree length, T the tree's sequence tokens
(its sequences concatenated in tree order, aligned with ``tree.token_index``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .flops import GPTShape, cost_weights, tree_cost
from .ragged import InputLayout
from .rows import TreeRows
from .tree import PackedTree

RESERVED_KEYS = ("input_ids", "position_ids", "tree", "attention_mask", "rows")


@dataclass(eq=False)
class MicroBatch:
    """One micro-batch of a packed batch: the rows it computes and the inputs of its loss.

    Attributes:
        tree: the :class:`PackedTree` whose sequences take their loss here (T sequence tokens).
        rows: the :class:`~megatron_tree.core.rows.TreeRows` it computes (n rows: the whole tree,
            a trunk-reuse part or branch, or a context-parallel rank's share).
        inputs: attached per-token inputs, each [T, ...] in tree order (``loss_mask``,
            ``advantages``, ``old_logprobs``, routes, ...).

    ``mb["tree"]``, ``mb["rows"]``, ``mb["input_ids"]``, ``mb["position_ids"]`` and ``mb[name]``
    for an attached input read the same fields (the loss function receives the inputs as a dict).
    """

    tree: PackedTree
    rows: TreeRows
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def input_ids(self) -> torch.Tensor:
        """int64 [1, n]: the token of each of its rows."""
        return self.rows.local(self.rows.tree.input_ids)[None]

    @property
    def position_ids(self) -> torch.Tensor:
        """int64 [1, n]: the depth of each of its rows."""
        return self.rows.local(self.rows.tree.position_ids)[None]

    def with_rows(self, rows: TreeRows) -> MicroBatch:
        """The same micro-batch computing ``rows`` (e.g. a context-parallel rank's share)."""
        return MicroBatch(self.tree, rows, dict(self.inputs))

    def __getitem__(self, key: str):
        if key in ("tree", "rows", "input_ids", "position_ids"):
            return getattr(self, key)
        return self.inputs[key]

    def get(self, key: str, default=None):
        if key in self:
            return self[key]
        return default

    def __contains__(self, key: str) -> bool:
        return key in ("tree", "rows", "input_ids", "position_ids") or key in self.inputs

    def loss_inputs(self) -> dict:
        """What a loss function reads: the attached inputs and ``tree``, ``rows``, ``input_ids``,
        ``position_ids``."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "tree": self.tree,
            "rows": self.rows,
            **self.inputs,
        }


def micro_batch(tree: PackedTree, rows: TreeRows | None = None) -> MicroBatch:
    """A :class:`MicroBatch` of ``tree`` computing ``rows`` (default all of ``tree``)."""
    return MicroBatch(tree, TreeRows.whole(tree) if rows is None else rows)


def batch_positions(tree: PackedTree) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch row [T], position in the row [T]) of every sequence token of ``tree``."""
    lengths = tree.sequence_lengths
    rows = tree.sequence_ids.repeat_interleave(lengths)
    starts = tree.cu_seqlens[:-1].repeat_interleave(lengths)
    return rows, torch.arange(tree.num_sequence_tokens, device=rows.device) - starts


def _cost(mb: dict, shape: GPTShape) -> float:
    """FLOPs of a micro-batch's rows (each real row at depth d attends d + 1 keys)."""
    rows = mb.rows
    if rows.is_whole:
        return tree_cost(mb.tree, shape)
    per_token, per_pair = cost_weights(shape)
    depth = rows.local(rows.tree.position_ids)[: rows.num_real]
    return per_token * rows.num_real + per_pair * float((depth + 1).sum())


def _check_name(name) -> None:
    if not isinstance(name, str) or name in RESERVED_KEYS:
        raise ValueError(f"name={name!r} is reserved or not a string; reserved: {RESERVED_KEYS}")


def _numpy_as_tensor(name: str, value):
    """A numpy array as a tensor (``torch.as_tensor``: no copy where it can be avoided); anything
    else as is."""
    import numpy as np

    from .checks import as_tensor

    return as_tensor(name, value) if isinstance(value, np.ndarray) else value


class TreeOutputs(list):
    """One tensor [T_mb, ...] per micro-batch of a packed batch, in tree layout (what a step's
    ``result.tree_outputs[name]`` holds); :meth:`PackedTreeBatch.attach` reads it as such."""


class PackedTreeBatch(Sequence):
    """The micro-batches of one packed batch, with the sharing statistics.

    Each micro-batch is a dict with ``"input_ids"``: int64 [1, N]; ``"position_ids"``: int64 [1, N]
    (token depth); ``"tree"``: :class:`PackedTree`; and every attached per-token tensor ``name`` as
    [T, ...] (sequence i of the tree is rows ``tree.cu_seqlens[i]:tree.cu_seqlens[i + 1]``).

    Attributes:
        batch_size: B, the number of input sequences.
        num_real_tokens: tokens of all sequences counted as if unpacked.
        num_tree_tokens: unique tokens after prefix sharing (over all micro-batches).
        num_padded_tokens: packed length including padding, over all micro-batches.
        num_dummy_trees: all-padding trees appended to match other data-parallel ranks.
        max_token_id: the largest token id in the packed inputs (padding included), checked
            against the model's vocabulary before a forward.
        cost_model: the :class:`GPTShape` the tree costs are measured with (None: no costs in the
            statistics; :meth:`tree_costs` then takes a shape).
        input_layout: the :class:`~megatron_tree.core.ragged.InputLayout` the batch was given in
            (padded, a list of sequences, a nested tensor or THD).
    """

    def __init__(
        self,
        micro_batches: list[dict],
        batch_size: int,
        num_real_tokens: int,
        max_token_id: int,
        *,
        cost_model: GPTShape | None = None,
    ):
        self.micro_batches = micro_batches
        self.batch_size = batch_size
        self.num_real_tokens = num_real_tokens
        self.max_token_id = max_token_id
        self.cost_model = cost_model
        # Each micro-batch counts its own rows: a trunk group's trunk is counted once.
        self.num_tree_tokens = sum(mb.rows.num_real for mb in micro_batches)
        self.num_padded_tokens = sum(mb.rows.num_rows for mb in micro_batches)
        self.num_dummy_trees = sum(mb.rows.num_real == 0 for mb in micro_batches)
        self._costs: list[float] | None = None
        self.input_layout = InputLayout("padded", ())  # set by build_packed_tree_batch

    @property
    def tree_token_ratio(self) -> float:
        """Unique tree tokens / real tokens (1.0 means nothing shared; lower is better)."""
        return self.num_tree_tokens / max(self.num_real_tokens, 1)

    def summary(self) -> dict:
        """The packing's statistics for a log line or a metrics dict: sequences, micro-batches
        (and how many are all-padding data-parallel fill-ins), trunk groups, tokens as if unpacked
        and computed (padding included), the tree-token ratio."""
        return {
            "sequences": self.batch_size,
            "micro_batches": len(self),
            "empty_micro_batches": self.num_dummy_trees,
            "trunk_groups": len({mb.rows.group for mb in self.micro_batches} - {None}),
            "tokens_unpacked": self.num_real_tokens,
            "tokens_computed": self.num_padded_tokens,
            "tree_token_ratio": self.tree_token_ratio,
        }

    def summary_line(self) -> str:
        """:meth:`summary` as ``key=value`` pairs."""
        return " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in self.summary().items()
        )

    @property
    def trees(self) -> list[PackedTree]:
        return [mb.tree for mb in self.micro_batches]

    def tree_costs(self, shape: GPTShape | None = None) -> list[float]:
        """Forward+backward FLOPs of every micro-batch's tree (linear layers per unique token plus
        attention per allowed pair; 0 for a dummy tree), under ``shape`` or else ``cost_model``."""
        if shape is None and self.cost_model is None:
            raise ValueError(
                "tree_costs needs a shape: pass a GPTShape, or pack with cost_model=..."
            )
        if shape is not None and shape != self.cost_model:
            return [_cost(mb, shape) for mb in self.micro_batches]
        if self._costs is None:
            self._costs = [_cost(mb, self.cost_model) for mb in self.micro_batches]
        return self._costs

    @property
    def min_tree_cost(self) -> float | None:
        """The cheapest real (non-dummy) tree's FLOPs under ``cost_model`` (None without one)."""
        costs = self._real_tree_costs()
        return min(costs) if costs else None

    @property
    def max_tree_cost(self) -> float | None:
        """The costliest tree's FLOPs under ``cost_model`` (None without one)."""
        costs = self._real_tree_costs()
        return max(costs) if costs else None

    def _real_tree_costs(self) -> list[float]:
        if self.cost_model is None:
            return []
        return [c for c, mb in zip(self.tree_costs(), self.micro_batches) if mb.rows.num_real]

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __getitem__(self, i):
        return self.micro_batches[i]

    def __iter__(self) -> Iterator[dict]:
        return iter(self.micro_batches)

    def __repr__(self) -> str:
        costs = ""
        if self.cost_model is not None and self.max_tree_cost is not None:
            costs = (
                f", tree_tflops_min={self.min_tree_cost / 1e12:.4g}"
                f", tree_tflops_max={self.max_tree_cost / 1e12:.4g}"
            )
        return (
            f"PackedTreeBatch(micro_batches={len(self)}, sequences={self.batch_size}, "
            f"real_tokens={self.num_real_tokens}, tree_tokens={self.num_tree_tokens}, "
            f"padded_tokens={self.num_padded_tokens}, "
            f"tree_token_ratio={self.tree_token_ratio:.4f}{costs})"
        )

    def attach(self, name: str, values) -> PackedTreeBatch:
        """Attach a per-token input to every micro-batch, in place; returns ``self``.

        Args:
            name: the key the micro-batches get (not one of ``RESERVED_KEYS``).
            values: in the layout the batch was packed from (``input_layout``): [B, L, ...] for a
                padded batch (L at least the longest sequence; numpy too), a list of [L_b, ...],
                a jagged nested tensor [B, j, ...] or THD [T, ...] for a ragged one; or the
                :class:`TreeOutputs` of a step on this batch (``result.tree_outputs[key]``: one
                [T_mb, ...] per micro-batch in tree layout, see :meth:`attach_tree`).
        """
        _check_name(name)
        if isinstance(values, TreeOutputs):
            return self.attach_tree(name, values)
        layout = self.input_layout
        if layout.kind != "padded":
            return self.attach_padded({name: layout.pad(name, values)})
        values = _numpy_as_tensor(name, values)
        if isinstance(values, (list, tuple)):
            warnings.warn(
                f"attach({name!r}, list): reading a plain list as one tree-layout tensor per "
                "micro-batch is deprecated (on a ragged batch a list is per sequence); pass "
                "result.tree_outputs[...] as it is, or call attach_tree",
                DeprecationWarning,
                stacklevel=2,
            )
            return self.attach_tree(name, values)
        return self.attach_padded({name: values})

    def attach_tree(self, name: str, values: Sequence[torch.Tensor]) -> PackedTreeBatch:
        """Attach one tensor [T_mb, ...] per micro-batch in tree layout (sequence i of a tree is
        entries ``tree.cu_seqlens[i]:tree.cu_seqlens[i + 1]``), e.g. a forward-only step's
        ``result.tree_outputs["logprobs"]``; numpy arrays too. Returns ``self``."""
        _check_name(name)
        values = [_numpy_as_tensor(f"{name}[{i}]", value) for i, value in enumerate(values)]
        if len(values) != len(self):
            raise ValueError(
                f"{name}: got {len(values)} tree-layout tensors for {len(self)} micro-batches"
            )
        for i, (mb, value) in enumerate(zip(self.micro_batches, values)):
            expected = mb.tree.num_sequence_tokens
            if not isinstance(value, torch.Tensor) or value.dim() < 1 or value.shape[0] != expected:
                shape = (
                    tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                )
                raise ValueError(
                    f"{name}: micro-batch {i} needs a tensor [T={expected}, ...] (its sequence "
                    f"tokens), got {shape}"
                )
        for mb, value in zip(self.micro_batches, values):
            mb.inputs[name] = value
        return self

    def attach_padded(self, values: dict[str, torch.Tensor]) -> PackedTreeBatch:
        """:meth:`attach` several tensors [B, L, ...] in the padded layout (numpy arrays too),
        reading each tree's token positions once for all of them."""
        longest = max(
            (int(t.sequence_lengths.max()) for t in self.trees if not t.is_dummy), default=0
        )
        values = {name: _numpy_as_tensor(name, value) for name, value in values.items()}
        for name, value in values.items():
            _check_name(name)
            if not isinstance(value, torch.Tensor):
                raise ValueError(
                    f"{name}: a padded-layout input must be a tensor (or numpy array) [B, L, ...], "
                    f"got {type(value).__name__}; convert it with torch.as_tensor"
                )
            if (
                value.is_nested
                or value.dim() < 2
                or value.shape[0] != self.batch_size
                or value.shape[1] < longest
            ):
                raise ValueError(
                    f"{name}: a padded-layout tensor must be [B, L, ...] with B = "
                    f"{self.batch_size} and L >= {longest} (the longest sequence), got "
                    f"{tuple(value.shape)}"
                )
        for mb in self.micro_batches:
            rows, cols = batch_positions(mb.tree)
            for name, value in values.items():
                mb.inputs[name] = value[rows.to(value.device), cols.to(value.device)]
        return self

    def to(self, device: torch.device | str) -> PackedTreeBatch:
        """A copy on ``device``: every tensor moved once (a trunk group's tree once for all its
        parts; ``input_ids`` / ``position_ids`` stay views)."""
        moved, trees = [], {}
        for mb in self.micro_batches:
            rows = mb.rows
            if id(rows.tree) not in trees:
                trees[id(rows.tree)] = rows.tree.to(device)
            tree = trees[id(rows.tree)] if mb.tree is rows.tree else mb.tree.to(device)
            inputs = {k: v.to(device) for k, v in mb.inputs.items()}
            moved.append(MicroBatch(tree, rows.to(device, trees[id(rows.tree)]), inputs))
        result = PackedTreeBatch(
            moved,
            self.batch_size,
            self.num_real_tokens,
            self.max_token_id,
            cost_model=self.cost_model,
        )
        result.input_layout = self.input_layout
        return result
