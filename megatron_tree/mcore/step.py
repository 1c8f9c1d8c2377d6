"""One tree-packed forward (and backward) through Megatron's pipeline schedule, loss as if unpacked.

Pack a rollout batch once, then step on it as often as the RL loop needs::

    packed = build_packed_tree_batch(batch, max_tokens_per_mb=16384)
    old = tree_forward_backward(model, packed, None, forward_only=True, collect_outputs=True)
    packed.attach("old_logprobs", old.tree_outputs["logprobs"])       # tree layout, no [B, L]
    for epoch in range(ppo_epochs):
        tree_forward_backward(model, packed, ppo_clipped_loss)

The step runs every tree through ``get_forward_backward_func()`` (pipeline parallelism included),
reads per-token outputs with a head (:class:`~megatron_tree.core.heads.LogProbs` or
:class:`~megatron_tree.core.heads.Values`) and weights every token so that the result is the loss of
the unpacked global batch. Its loss function speaks Megatron's protocol: ``(loss, num_tokens,
logs)``, with Megatron's per-token mode (``calculate_per_token_loss``), because trees hold
different numbers of tokens and a mean per micro-batch would weight tokens unequally.

Legend: B batch size, L padded length, N packed tree length, T tokens of a tree's sequences.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from dataclasses import dataclass, field, fields, replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from ..core.batch import PackedTreeBatch, TreeOutputs
from ..core.checks import check_bool
from ..core.context_parallel import context_parallel_split
from ..core.heads import LogProbs, Values
from ..core.packing import build_packed_tree_batch
from ..core.results import merge_packed_tree_results
from .moe import check_replaying, replay_routes, replaying, router_losses_on
from .moe_stats import ExpertTokenCounter
from .schedule import StepContext, run_phases
from .spec import check_tree_model
from .token_loss import LossFn, TokenLoss, TreeHead, check_loss_fn, loss_scale, step_weights

logger = logging.getLogger(__name__)


@dataclass
class TreeStepResult:
    """What one step did.

    ``loss`` is this rank's share of the global batch loss (the shares of all data-parallel ranks
    add up to it); None on pipeline stages other than the last and without a ``loss_fn``.
    ``tree_outputs`` (with ``collect_outputs=True``, last stage only): each head output
    (``logprobs``, ``entropy`` or ``values``) as :class:`TreeOutputs`, one detached [T] tensor per
    micro-batch of ``packed``, ready for ``packed.attach``; :meth:`merged_outputs` turns them into
    [B, L]. ``expert_tokens`` (with ``moe_stats=True``): int64 [E], tokens this rank routed to each
    expert, summed over its layers.
    """

    loss: torch.Tensor | None
    packed: PackedTreeBatch
    seconds: dict[str, float] = field(default_factory=dict)
    tree_outputs: dict[str, TreeOutputs] | None = None
    expert_tokens: torch.Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return self.packed.batch_size

    @property
    def num_micro_batches(self) -> int:
        return len(self.packed)

    @property
    def tree_token_ratio(self) -> float:
        return self.packed.tree_token_ratio

    def merged_outputs(self, max_seq_len: int | None = None) -> dict[str, torch.Tensor]:
        """``tree_outputs`` in the layout the batch was given in (rolled for log-probs: entry t is
        token t + 1's, the last is 0): [B, L] for a padded batch (0 past each sequence); for a
        ragged one its own layout (a list of [L_b], a nested tensor or THD [T],
        :mod:`megatron_tree.core.ragged`)."""
        if self.tree_outputs is None:
            raise ValueError(
                "no outputs were collected: pass collect_outputs=True (last pipeline stage)"
            )
        layout = self.packed.input_layout
        return {
            name: layout.restore(
                merge_packed_tree_results(
                    list(zip(values, self.packed.trees)),
                    self.packed.batch_size,
                    max_seq_len=max_seq_len,
                )
            )
            for name, values in self.tree_outputs.items()
        }

    def _trunk_summary(self) -> str:
        parts = [mb.rows for mb in self.packed if mb.rows.group is not None]
        if not parts:
            return ""
        trunks = [p.num_real for p in parts if p.is_trunk]
        return f" trunks={len(trunks)} (tokens {sum(trunks)}) branches={len(parts) - len(trunks)}"

    def _kernel_summary(self) -> str:
        """How many micro-batches share nothing (each sequence a chain): their attention runs the
        dense causal kernel rather than a tree kernel (see :mod:`megatron_tree.core.attention`)."""
        chains = sum(mb.rows.chains is not None for mb in self.packed)
        return f" causal_micro_batches={chains}" if chains else ""

    def log_line(self) -> str:
        p = self.packed
        times = " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in self.seconds.items())
        loss = "n/a (forward only)" if self.loss is None else f"{float(self.loss):.6f}"
        return (
            f"tree step: loss={loss} sequences={p.batch_size} trees={len(p)} (dummy "
            f"{p.num_dummy_trees}) tokens real={p.num_real_tokens} tree={p.num_tree_tokens} "
            f"padded={p.num_padded_tokens} "
            f"tree_token_ratio={p.tree_token_ratio:.4f}{self._trunk_summary()}"
            f"{self._kernel_summary()} {times}"
            + (
                ""
                if self.expert_tokens is None
                else f" expert_tokens={self.expert_tokens.tolist()}"
            )
        )


@dataclass(frozen=True)
class PackingConfig:
    """How the step packs an unpacked batch: the packer's options, each default decided once.

    :meth:`resolve` turns them into :func:`build_packed_tree_batch`'s keyword arguments.

    Attributes:
        max_tokens_per_mb: a tree's unique-token capacity (required to pack).
        block_size: attention tile the packed length is aligned to (None: the packer's, 128).
        parallel_size: another factor of every packed length; the step adds the CP size (times
            the TP size under sequence parallelism).
        pad_to_max: pad every tree to ``max_tokens_per_mb``. None (default): True where the step
            needs constant shapes (pipeline parallelism, the allgather expert dispatcher), False
            otherwise (each tree padded only to its alignment).
        share_prefixes: pack prefix tries (False: each sequence its own chain).
        share_trunks: trunk reuse for prompt groups larger than a micro-batch (None: on).
    """

    max_tokens_per_mb: int | None = None
    block_size: int | None = None
    parallel_size: int | None = None
    pad_to_max: bool | None = None
    share_prefixes: bool | None = None
    share_trunks: bool | None = None

    def resolve(self, *, constant_shapes: str | None, align: int) -> dict:
        """The packer's keyword arguments. ``constant_shapes``: why the step needs trees of one
        length (None: it does not); ``align``: the factor every packed length needs."""
        for name in ("pad_to_max", "share_prefixes", "share_trunks"):
            check_bool(name, getattr(self, name), optional=True)
        if self.max_tokens_per_mb is None:
            raise ValueError(
                "max_tokens_per_mb is required to pack a batch (or pass a PackedTreeBatch)"
            )
        if constant_shapes and self.pad_to_max is False:
            raise ValueError(
                f"pad_to_max=False gives trees of different lengths, but {constant_shapes} needs "
                "trees of one length: use pad_to_max=True (or None, the default)"
            )
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)}
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        kwargs["pad_to_max"] = bool(constant_shapes) if self.pad_to_max is None else self.pad_to_max
        kwargs["parallel_size"] = math.lcm(self.parallel_size or 1, align)
        return kwargs


@dataclass(frozen=True)
class ProcessGroups:
    """The step's process groups. None: Megatron's where the model is built with that
    parallelism (tensor, context), none otherwise; ``dp`` None: this rank normalizes alone.

    Attributes:
        tp: the group the logits' vocabulary is sharded over.
        dp: data parallelism (without context parallelism): the loss normalization counts every
            rank's tokens, and a batch packed here runs as many trees on every rank.
        cp: context parallelism: each tree is split across it by attention work.
        grad_average: the caller's gradient reduction averages over the DP x CP ranks (Megatron
            DDP's default); ignored where Megatron divides the gradients itself.
    """

    tp: dist.ProcessGroup | None = None
    dp: dist.ProcessGroup | None = None
    cp: dist.ProcessGroup | None = None
    grad_average: bool = True

    @classmethod
    def from_megatron(cls) -> ProcessGroups:
        """Megatron's tensor-, data- and context-parallel groups (``parallel_state``)."""
        return cls(
            tp=parallel_state.get_tensor_model_parallel_group(),
            dp=parallel_state.get_data_parallel_group(),
            cp=parallel_state.get_context_parallel_group(),
        )

    def resolve(self, config) -> ProcessGroups:
        """Checked against the model's config; groups of one rank become None."""
        check_bool("grad_average", self.grad_average)
        tp = _model_group(
            self.tp,
            config.tensor_model_parallel_size,
            "tensor",
            parallel_state.get_tensor_model_parallel_group,
        )
        cp = _model_group(
            self.cp,
            config.context_parallel_size,
            "context",
            parallel_state.get_context_parallel_group,
        )
        return replace(self, tp=tp, cp=cp)


def _model_group(group, size: int, name: str, megatron_group):
    if group is None and size > 1:
        group = megatron_group()
    got = 1 if group is None else dist.get_world_size(group)
    if got != size:
        raise ValueError(
            f"the model was built with {name}_model_parallel_size={size} but the {name}-parallel "
            f"group has {got} ranks; pass the model's group (or None for Megatron's)"
        )
    return group if got > 1 else None


_LEGACY_GROUPS = {
    "tp_group": "tp",
    "dp_group": "dp",
    "cp_group": "cp",
    "dp_grad_average": "grad_average",
}
_LEGACY_PACKING = tuple(f.name for f in fields(PackingConfig))


def _legacy(groups, packing, legacy: dict) -> tuple[ProcessGroups, PackingConfig | None]:
    """The keyword arguments of earlier releases, mapped onto ``groups`` / ``packing``."""
    unknown = set(legacy) - set(_LEGACY_GROUPS) - set(_LEGACY_PACKING) - {"recompute_trunks"}
    if unknown:
        raise TypeError(
            f"tree_forward_backward() got unexpected keyword arguments {sorted(unknown)}"
        )
    groups = groups or ProcessGroups()
    moved = {_LEGACY_GROUPS[k]: v for k, v in legacy.items() if k in _LEGACY_GROUPS}
    if moved:
        warnings.warn(
            f"tree_forward_backward({', '.join(k for k in legacy if k in _LEGACY_GROUPS)}=...) is "
            "deprecated: pass groups=ProcessGroups(tp=..., dp=..., cp=..., grad_average=...)",
            DeprecationWarning,
            stacklevel=3,
        )
        groups = replace(groups, **moved)
    packed_args = {k: v for k, v in legacy.items() if k in _LEGACY_PACKING and v is not None}
    if packed_args:
        warnings.warn(
            f"tree_forward_backward({', '.join(packed_args)}=...) is deprecated: pack with "
            "build_packed_tree_batch, or pass packing=PackingConfig(...)",
            DeprecationWarning,
            stacklevel=3,
        )
        packing = replace(packing or PackingConfig(), **packed_args)
    if legacy.get("recompute_trunks") is False:
        raise ValueError(
            "recompute_trunks=False (the trunk parts' activations kept until their backward) was "
            "removed: trunk reuse runs through Megatron's schedules with the trunk parts "
            "recomputed (docs/trunk-reuse.md); drop the argument"
        )
    if legacy.get("recompute_trunks") is not None:
        warnings.warn(
            "tree_forward_backward(recompute_trunks=...) is deprecated: trunk parts are always "
            "recomputed (one schedule, docs/trunk-reuse.md); drop the argument",
            DeprecationWarning,
            stacklevel=3,
        )
    return groups, packing


def tree_forward_backward(
    model,
    batch: PackedTreeBatch | dict,
    loss_fn: LossFn | None = None,
    *,
    gather: LogProbs | Values = LogProbs(),  # noqa: B008 (frozen, immutable)
    normalization: str = "token",
    forward_only: bool = False,
    collect_outputs: bool = False,
    groups: ProcessGroups | None = None,
    packing: PackingConfig | None = None,
    route_key: str | None = None,
    moe_stats: bool = False,
    **legacy,
) -> TreeStepResult:
    """Run a packed batch forward (and backward) through Megatron's schedule.

    Args:
        model: a Megatron model built with tree attention and depth RoPE (``TreeGPTModel`` with
            ``tree_attention_spec``, or a bridge under ``patch_bridge_for_tree_training``), or the
            list of its model chunks under virtual (interleaved) pipeline parallelism. Its last
            stage returns vocab-parallel logits [1, N, V/tp] (for :class:`LogProbs`) or values
            [1, N, 1] (for :class:`Values`); N is this rank's rows under context parallelism.
        batch: a :class:`PackedTreeBatch` (pack once with ``build_packed_tree_batch``, step many
            times), or an unpacked batch (padded [B, L] or ragged, as the packer takes it) packed
            here with ``packing``. Per-token inputs: ``loss_mask`` (optional; for log-probs it is
            rolled, entry t weights the loss about token t + 1) and what ``loss_fn`` reads.
        loss_fn: ``loss_fn(outputs, inputs) -> [T]`` per-token loss; ``outputs`` holds the head's
            outputs [T], ``inputs`` the micro-batch's inputs [T]. None: forward only.
        gather: the head: ``LogProbs(temperature=...)`` or ``Values()`` (an instance).
        normalization: ``"token"`` (mean over all loss tokens) or ``"sequence"`` (mean of the
            per-sequence means of the sequences with loss tokens), over the global batch.
        forward_only: no backward (old / reference log-probs, evaluation).
        collect_outputs: keep the head's outputs (``result.tree_outputs``).
        groups: :class:`ProcessGroups` (default: Megatron's TP / CP groups where the model has
            that parallelism, no DP normalization). Under CP every CP rank returns the whole loss
            and all outputs.
        packing: :class:`PackingConfig` for an unpacked ``batch``; refused with a packed one.
        route_key: MoE routing replay: the per-token input holding the routes the rollout engine
            recorded ([B, L, num_layers, topk] unpacked, packed with the trie keyed on token +
            route); the model needs ``moe_enable_routing_replay=True``.
        moe_stats: count the tokens each expert receives (``result.expert_tokens``, a host read
            per router call).
        legacy: the keyword arguments of earlier releases (``tp_group``, ``dp_group``,
            ``cp_group``, ``dp_grad_average``, the packing options), deprecated.

    Returns:
        :class:`TreeStepResult`; its loss equals the unpacked batch's.
    """
    groups, packing = _legacy(groups, packing, legacy)
    for name, value in dict(
        forward_only=forward_only, collect_outputs=collect_outputs, moe_stats=moe_stats
    ).items():
        check_bool(name, value)
    if loss_fn is None and not forward_only:
        raise ValueError(
            "loss_fn is required for a training step; pass loss_fn or forward_only=True"
        )
    _check_gather(gather)
    chunks = _model_chunks(model)
    config = get_model_config(chunks[0])
    groups = groups.resolve(config)
    t0 = time.perf_counter()
    packed = _packed(batch, packing, route_key, config, groups)
    _check_vocabulary(chunks[0], packed)
    check_loss_fn(loss_fn, gather, packed[0])
    weights, counts, total = step_weights(packed, gather, normalization, groups.dp)
    averaged = [groups.dp, groups.cp] if groups.grad_average else []
    scale = loss_scale(config, counts, total, forward_only, averaged)
    device = next(chunks[0].parameters()).device
    on_device = split_for_context_parallel(packed, groups.cp).to(device)
    if route_key is not None:
        check_replaying(chunks, route_key)
    ctx = StepContext(
        chunks,
        config,
        moe=bool(config.num_moe_experts),
        loss_scale=scale,
        routes=None if route_key is None else replay_routes(on_device, route_key),
        router_stats=router_losses_on(config),
        ep_group=groups.dp if expert_parallel(config) else None,
    )
    _check_dropout(config, on_device, forward_only)
    loss = TokenLoss(
        loss_fn,
        [w.to(device=device, dtype=torch.float32) for w in weights],
        counts,
        scale,
        report=groups.cp is None or dist.get_rank(groups.cp) == 0,
        collect=collect_outputs,
    )
    head = TreeHead(gather, groups.tp, packed.max_token_id)
    timings = {"prepare": time.perf_counter() - t0}
    t1 = time.perf_counter()
    counter = ExpertTokenCounter(chunks) if moe_stats else contextlib.nullcontext()
    with replaying(chunks) if route_key is not None else contextlib.nullcontext(), counter:
        run = run_phases(ctx, list(on_device), head, loss, forward_only=forward_only)
    timings["forward" if forward_only else "forward_backward"] = time.perf_counter() - t1
    expert_tokens = counter.totals() if moe_stats and counter.per_layer else None
    return _result(run.logs, total, packed, loss, timings, expert_tokens)


def _check_gather(gather) -> None:
    if isinstance(gather, type) or not all(
        hasattr(gather, name) for name in ("gather", "check_output", "default_loss_mask", "outputs")
    ):
        raise ValueError(
            f"gather={gather!r} is not a head: pass an instance, gather=LogProbs() (or "
            "LogProbs(temperature=..., entropy=...)) or gather=Values()"
        )


def _model_chunks(model) -> list:
    chunks = model if isinstance(model, list) else [model]
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    if len(chunks) != vpp:
        raise ValueError(
            f"got {len(chunks)} model chunks but the virtual pipeline size is {vpp}; pass one "
            "chunk per virtual stage (the list Megatron's get_model returns)"
        )
    for chunk in chunks:
        check_tree_model(chunk)
    if getattr(get_model_config(chunks[0]), "overlap_moe_expert_parallel_comm", False):
        raise ValueError(
            "overlap_moe_expert_parallel_comm=True runs the model's preprocessing outside its "
            "forward, where the rotary table does not follow token depth: set it to False"
        )
    return chunks


def expert_parallel(config) -> bool:
    return (
        bool(config.num_moe_experts) and parallel_state.get_expert_model_parallel_world_size() > 1
    )


def constant_shapes(config) -> str | None:
    """Why the step needs trees of one length, or None."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        return "pipeline parallelism (stages exchange fixed-shape activations)"
    if expert_parallel(config) and config.moe_token_dispatcher_type == "allgather":
        return "the allgather token dispatcher (it gathers equal-length token blocks)"
    return None


def _packed(batch, packing, route_key, config, groups: ProcessGroups) -> PackedTreeBatch:
    """The packed batch to step on: ``batch`` itself (checked), or ``batch`` packed here."""
    if expert_parallel(config) and groups.dp is None:
        raise ValueError(
            f"expert_model_parallel_size={parallel_state.get_expert_model_parallel_world_size()}: "
            "expert-parallel ranks are data-parallel ranks and must run the same number of "
            "trees; pass groups=ProcessGroups(dp=parallel_state.get_data_parallel_group())"
        )
    align = config.context_parallel_size * (
        config.tensor_model_parallel_size if config.sequence_parallel else 1
    )
    constant = constant_shapes(config)
    if not isinstance(batch, PackedTreeBatch):
        kwargs = (packing or PackingConfig()).resolve(constant_shapes=constant, align=align)
        if route_key is not None:
            kwargs["route_key"] = route_key
        kwargs.setdefault("share_trunks", True)
        return build_packed_tree_batch(batch, dp_group=groups.dp, **kwargs)
    if packing is not None:
        raise ValueError(
            "packing applies to an unpacked batch, but this batch is already packed; pass the "
            "options to build_packed_tree_batch instead"
        )
    lengths = {mb.rows.num_rows for mb in batch}
    if constant and len(lengths) > 1:
        raise ValueError(
            f"the packed batch has trees of different lengths {sorted(lengths)[:4]}, but "
            f"{constant} needs trees of one length; pack with pad_to_max=True"
        )
    bad = [n for n in lengths if n % align]
    if bad:
        raise ValueError(
            f"packed lengths {bad[:4]} are not multiples of {align} (the context-parallel size, "
            f"times the tensor-parallel size under sequence parallelism); pack with "
            f"parallel_size={align}"
        )
    return batch


def _check_vocabulary(chunk, packed: PackedTreeBatch) -> None:
    model = chunk
    while not hasattr(model, "vocab_size") and hasattr(model, "module"):  # Float16Module, DDP
        model = model.module
    vocab_size = getattr(model, "vocab_size", None)
    if vocab_size is not None and packed.max_token_id >= vocab_size:
        raise ValueError(
            f"the batch holds token id {packed.max_token_id} (pad_token_id included), outside the "
            f"model's vocabulary [0, {vocab_size})"
        )


def _check_dropout(config, micro_batches, forward_only: bool) -> None:
    """Recomputed trunk parts must reproduce their first pass."""
    dropout = max(config.hidden_dropout, config.attention_dropout)
    if not forward_only and dropout > 0 and any(mb.rows.records for mb in micro_batches):
        raise ValueError(
            "recomputed trunk parts must reproduce their first pass, but the model has dropout "
            f"{dropout} (hidden_dropout / attention_dropout): set them to 0 (RL training usually "
            "does), or pack with share_trunks=False"
        )


def _result(logs, total, packed, loss: TokenLoss, timings, expert_tokens) -> TreeStepResult:
    value = None
    logs = [d for d in logs if "loss" in d]
    if logs and loss.loss_fn is not None:
        value = (torch.stack([d["loss"][0] for d in logs]).sum() / max(total, 1e-30)).float()
    tree_outputs = None
    if loss.collected:
        names = next(iter(loss.collected.values()))
        tree_outputs = {
            name: TreeOutputs(loss.collected[i][name] for i in range(len(packed))) for name in names
        }
    result = TreeStepResult(
        loss=value,
        packed=packed,
        seconds=timings,
        tree_outputs=tree_outputs,
        expert_tokens=expert_tokens,
    )
    logger.info(result.log_line())
    return result


def split_for_context_parallel(packed: PackedTreeBatch, cp_group) -> PackedTreeBatch:
    """Each micro-batch with this CP rank's rows (split on the host, before the batch moves)."""
    if cp_group is None:
        return packed
    size, rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    split = [mb.with_rows(context_parallel_split(mb.rows, size, rank, cp_group)) for mb in packed]
    result = PackedTreeBatch(
        split,
        packed.batch_size,
        packed.num_real_tokens,
        packed.max_token_id,
        cost_model=packed.cost_model,
    )
    result.input_layout = packed.input_layout
    return result
