"""Tree training inside verl's Megatron engine (verl 0.9.x), switched on by
``VERL_ENGINE_VENDOR=megatron_tree``, without a line of verl changed.

Importing this module (verl does, through the ``verl.plugins`` entry point that installing
megatron_tree registers) adds :class:`TreeMegatronEngineWithLMHead` to verl's ``EngineRegistry``
under the vendor ``megatron_tree``. The engine is verl's ``MegatronEngineWithLMHead`` with three
things changed:

* the model is built inside :func:`~megatron_tree.bridges.mbridge.patch_bridge_for_tree_training`
  (verl's mbridge path) or the Megatron-Bridge patch (its default path), so it is a
  ``TreeGPTModel`` with tree attention;
* micro-batches are trees: :func:`~megatron_tree.core.packing.build_packed_tree_batch` packs the
  rank's batch into prefix tries of at most the batch's token budget (verl's own token-budget
  micro-batching splits prompt groups), and a prompt group larger than that runs with trunk reuse
  (its trunk computed once, as trunk parts, its branches attending to the trunk's keys and values);
  verl's sample order is restored from the trees' sequence ids exactly as verl restores its
  dynamic batches;
* the schedule: the package's one schedule (:func:`~megatron_tree.mcore.schedule.run_phases`,
  trunk groups included) runs in place of Megatron's ``forward_backward_func``, with verl's head
  and loss at its two seams: the head is verl's own logits processor at a micro-batch's rows'
  tokens (labels rolled within each sample as verl rolls them, :class:`_VerlHead`), the loss verl's
  ``postprocess_micro_batch_func`` on the per-sample outputs of the samples ending in it
  (:class:`_VerlLoss`), so verl's losses, metrics and output layout are unchanged.

The critic's engine (:class:`TreeMegatronEngineWithValueHead`) is verl's value engine with the same
changes; each sample's values are the value head at its own tokens' rows. Data-parallel ranks run
as many micro-batches (all-padding ones appended, which add no output or loss). On verl's single
controller, :func:`patch_trainer_balancing` keeps each prompt group on one data-parallel rank where
verl would balance sequence lengths and split groups; with the vendor variable set, importing this
module arranges that by itself (:func:`balance_on_trainer_import`), so the launcher is unchanged
(verl's legacy trainer, ``trainer.use_v1=false``; its v1 trainer balances transfer-queue metadata
and is not changed). Both of verl's model paths are tested (vanilla mbridge; Megatron-Bridge, its
default, on a transformers-5 stack).

Parallelism is verl's layout (its engine config: TP, DP, PP, VPP, CP), run by the same schedule
as the package's step.

* Pipeline (PP) and virtual pipeline (VPP): the schedule runs over verl's pipeline groups and
  model chunks; the head and verl's loss run on the last stage, whose ranks return verl's outputs
  in verl's order, the other stages none (as verl's own engine). Trees are padded to the capacity
  where the stages need one length (:func:`_needs_constant_shapes`): under VPP, and wherever the
  config does not exchange shapes; a one-chunk pipeline of verl's configs (both model paths set
  ``variable_seq_lengths``) runs each tree at its own length.
* Context parallelism (CP): each tree's rows are split over the CP ranks by attention work
  (:func:`~megatron_tree.mcore.step.split_for_context_parallel`; keys and values all-gathered in
  attention), trunk parts included; each rank computes its rows' per-token outputs, summed over the
  CP group, so every rank hands verl's loss every sample's outputs in verl's layout. A tree holds
  up to ``max_token_len_per_gpu`` x CP tokens, as verl's own micro-batches under CP. verl's
  ``(loss, output)`` protocol needs nothing more (Megatron multiplies the loss by the CP size for
  the gradient average over DP x CP); with ``calculate_per_token_loss`` (verl's per-token protocol,
  which verl's own CP path asks for) each CP rank reports its exact share of a micro-batch's tokens
  (verl's ``tokens // cp`` on every rank would drop up to cp - 1 per micro-batch from the count the
  gradients are divided by).

* Routing replay (verl's ``router_replay.mode``, its MoE routers patched with verl's
  ``RouterReplay``), expert parallelism included. R2: verl's old-log-prob pass without
  ``routed_experts`` records; the routers' choices for every micro-batch's rows are kept per tree
  position (a trunk group's tree filled by its parts, :class:`_RouteRecorder`) and each sample's
  routes at its own tokens go to verl's bookkeeping, which returns them per sample in verl's
  layout, as from its own engine. Its other passes, and every R3 pass, replay ``routed_experts``:
  re-laid per tree position by the packer (``route_key``: two samples share a position only where
  their routes agree) and handed to the routers with each micro-batch
  (:func:`~megatron_tree.mcore.moe.replay_routes`); under R3 a sample's last token routes
  natively, as verl's replay mask has it (:meth:`_TreeEngine._routes_to_replay`). Under PP each
  stage records its own layers' routes and verl's bookkeeping gathers them; under VPP each model
  chunk replays its layers' columns (global layer numbers) and records its routers' choices after
  its forward into the stage's table in layer order (verl's per-chunk reordering skipped,
  :func:`_merged_routes`); under sequence parallelism a router sees its TP rank's contiguous
  n / TP rows, the replayed table is cut the same way and the recorded shards are gathered over
  the TP group; under CP each rank records its rows' routes and the CP group sums the tables (a
  CP rank replays its rows' routes). Tested against verl's stock engine at PP=2 x VPP=2 and at
  TP=2 with sequence parallelism, R2 and R3 (log-probs within 3e-6, loss 4e-7 and gradients 4e-6
  relative, recorded routes equal).

Refused with the reason: verl's dynamic context parallelism (its scheduler replaces the
micro-batches), top-k distillation with trunk reuse or CP.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from megatron.core import parallel_state as mpu
from megatron.core.utils import get_model_config
from verl.utils import tensordict_utils as tu
from verl.workers.engine import EngineRegistry
from verl.workers.engine.megatron import transformer_impl
from verl.workers.engine.megatron.transformer_impl import (
    MegatronEngineWithLMHead,
    MegatronEngineWithValueHead,
)

from ..mcore.moe import check_replaying, replay_routes, replaying
from ..mcore.schedule import Phases, StepContext, run_phases
from ..mcore.step import constant_shapes, expert_parallel, split_for_context_parallel
from ..patches._scoped import swapped
from .common import log_packing, tree_capacity
from .verl_balance import (  # noqa: F401  (the balancing names, importable from here too)
    balance_on_trainer_import,
    balance_prompt_groups,
    patch_trainer_balancing,
    tree_balance_batch,
)
from .verl_common import (
    ROUTE_KEY,
    VENDOR,
    nested,
    sample_temperatures,
    tree_micro_batches,
)


@contextlib.contextmanager
def _tree_bridges(backend: str):
    """Both of verl's bridge paths build tree models inside this block."""
    with contextlib.ExitStack() as stack:
        if importlib.util.find_spec("mbridge") is not None:
            from ..bridges.mbridge import patch_bridge_for_tree_training

            stack.enter_context(patch_bridge_for_tree_training(backend=backend))
        if importlib.util.find_spec("megatron.bridge") is not None:
            from ..bridges.megatron_bridge import patch_megatron_bridge_for_tree_training

            stack.enter_context(patch_megatron_bridge_for_tree_training(backend=backend))
        yield


class _TokenRows(NamedTuple):
    """The sequence tokens of a tree that one micro-batch's rows compute, with what verl's head
    needs for them (built on the host before the step; t of the tree's T tokens).

    Attributes: size T; lengths (the tree's samples' token counts, host ints); tokens [t] (their
    places in the tree's token order, None: all T in order); rows [t] (the micro-batch's row of
    each); labels [t] (the next token of the sample, rolled as verl rolls: the last token's label is
    the sample's first); temperature [t].
    """

    size: int
    lengths: tuple[int, ...]
    tokens: torch.Tensor | None
    rows: torch.Tensor
    labels: torch.Tensor
    temperature: torch.Tensor

    @classmethod
    def of(cls, tree, rows, temperature: torch.Tensor) -> _TokenRows:
        """``temperature``: per sample of the verl batch [B] (``tree.sequence_ids`` index it)."""
        cu = tree.cu_seqlens
        size = int(cu[-1])
        successor = torch.arange(1, size + 1, device=cu.device)
        successor[cu[1:] - 1] = cu[:-1]
        labels = tree.input_ids[tree.token_index[successor]]
        lengths = cu.diff()
        temperature = temperature[tree.sequence_ids].float().repeat_interleave(lengths)
        local = rows.local_index[tree.token_index]
        host_lengths = tuple(lengths.tolist())
        if rows.is_whole:
            return cls(size, host_lengths, None, local, labels, temperature)
        here = torch.nonzero(local >= 0).flatten()
        return cls(size, host_lengths, here, local[here], labels[here], temperature[here])

    def to(self, device) -> _TokenRows:
        return _TokenRows(
            self.size,
            self.lengths,
            None if self.tokens is None else self.tokens.to(device),
            *(t.to(device) for t in (self.rows, self.labels, self.temperature)),
        )

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[t, ...] at these tokens -> [T, ...], 0 at the tree's other tokens."""
        if self.tokens is None:
            return values
        full = values.new_zeros((self.size, *values.shape[1:]))
        return full.index_copy(0, self.tokens, values)


class _VerlHead:
    """:class:`~megatron_tree.mcore.schedule.Head`: verl's logits processor (or value head) at a
    micro-batch's rows' tokens.

    Args:
        head: the engine's ``_tree_head`` with the step's flags bound: (model output, _TokenRows)
            -> per-token outputs.
        token_rows: per packed micro-batch's rows (by id), (its rows' tokens of its own tree or
            None when no sample ends in it, of its group's tree or None when it is no trunk part).
    """

    def __init__(self, head, token_rows: dict[int, tuple]):
        self.head, self.token_rows = head, token_rows

    def __call__(self, output: torch.Tensor, tree, rows) -> dict[str, torch.Tensor]:
        own, group = self.token_rows.get(id(rows), (None, None))
        token_rows = group if rows.records and tree is rows.tree else own
        if token_rows is None:  # no sample's tokens (a trunk part no sample ends in)
            return {"_": output.flatten()[:0].float().sum()[None]}
        outputs = self.head(output, token_rows)
        if rows.cp_positions is None:
            return outputs
        # A CP rank computed its rows' tokens (0 elsewhere): the sum over the CP group completes
        # them (backward the identity, so each rank's gradient reaches only its own rows).
        return {k: rows.complete([v])[0] for k, v in outputs.items()}


class _VerlLoss:
    """:class:`~megatron_tree.mcore.schedule.Loss`: verl's ``postprocess_micro_batch_func`` on the
    per-sample outputs of the samples ending in a micro-batch: verl's ``(loss, output)``, which
    Megatron divides by the schedule call's micro-batch count (and multiplies by the CP size: each
    CP rank's gradient is its rows' share of the whole loss's) and verl multiplies back; or, with
    ``calculate_per_token_loss``, verl's ``(loss sum, tokens, output)``.

    Args:
        micro_batches: verl's micro-batches (on the device), one per packed micro-batch.
        lengths: per packed micro-batch, its samples' token counts (host ints from packing).
        postprocess: verl's ``postprocess_micro_batch_func`` with the step's loss function.
        model_output: per-sample outputs {name: nested [b, j]} -> what verl's forward step hands
            its postprocess (the engine's ``_tree_model_output``).
        token_share: in per-token mode under CP, a micro-batch's verl data -> the tokens this CP
            rank reports (None: verl's own count).
    """

    def __init__(self, micro_batches, lengths, postprocess, model_output, token_share=None):
        self.micro_batches, self.lengths = micro_batches, lengths
        self.postprocess, self.model_output = postprocess, model_output
        self.token_share = token_share
        self.outputs: dict[int, dict] = {}  # verl's output of each micro-batch that took a loss

    def __call__(self, index: int, mb, outputs: dict, *, num_micro_batches: int):
        if mb.tree.num_sequences == 0:
            # No sample ends here (a trunk part): no loss, and 0 loss tokens in the per-token
            # form, so that the schedule can report the tokens of the calls it held back.
            zero = sum(v.sum() for v in outputs.values()) * 0.0
            return zero, torch.zeros((), dtype=torch.int, device=zero.device), {}
        data = self.micro_batches[index]
        tu.assign_non_tensor(data, num_micro_batch=num_micro_batches)
        per_sample = {k: nested(list(v.split(self.lengths[index]))) for k, v in outputs.items()}
        result = self.postprocess(self.model_output(per_sample), data=data)
        self.outputs[index] = result[-1]
        if len(result) == 3 and self.token_share is not None:
            result = (result[0], self.token_share(data), result[2])
        return result


class _RouteRecorder:
    """verl's R2 record pass (old log-probs) on trees: after each model chunk's forward, the experts
    its routers chose for the micro-batch's rows [n, topk], kept per position of the rows' tree (a
    trunk group's tree is filled by its parts) and per layer of this stage (every model chunk's
    MoE layers, in layer order: under VPP a stage's chunks hold its layers in that order); then
    each sample's routes at its own tokens, in verl's layout (this stage's MoE layers; verl's
    bookkeeping gathers the stages').

    A router keeps its choices until its next call, and under VPP a chunk may run the next
    micro-batch before the following chunk runs this one, so each chunk's routes are read by a
    forward hook on that chunk (:meth:`recording`), which finds the call's rows by its tree mask
    (handed over by :class:`_RecordingContext`). Under sequence parallelism a router sees this
    TP rank's contiguous shard of the rows, and the TP group gathers the shards. Under CP each rank
    records its rows' routes, and the tables are summed over the CP group (each position is one
    rank's row) before they are read (:meth:`gather`).

    Args:
        chunks: the model chunks (one per virtual pipeline stage).
        topk: the routers' k (the width of a stage without MoE layers' empty table).
        sp_group: the TP group under sequence parallelism (TP > 1), else None.
    """

    def __init__(self, chunks, topk: int, sp_group=None):
        per_chunk = [_recording_routers([chunk]) for chunk in chunks]
        self.routers = sorted(
            (router for routers in per_chunk for router in routers),
            key=lambda router: router.layer_number,
        )
        column = {id(router): i for i, router in enumerate(self.routers)}
        self.chunks, self.topk, self.sp_group = list(chunks), topk, sp_group
        self.per_chunk = [
            (routers, torch.tensor([column[id(r)] for r in routers], dtype=torch.long))
            for routers in per_chunk
        ]
        self.tables: dict = {}  # per tree (a trunk group's, or a micro-batch's rows): [N, L, topk]
        self.rows_of: dict = {}  # id(tree mask) -> (the mask, its micro-batch's rows)

    @staticmethod
    def _key(rows):
        return ("group", rows.group) if rows.group is not None else id(rows)

    def expect(self, mask, rows) -> None:
        """The chunks' calls with ``mask`` run ``rows``."""
        self.rows_of[id(mask)] = (mask, rows)

    @contextlib.contextmanager
    def recording(self):
        """Each chunk's routes recorded after its forward (a forward hook per chunk)."""
        handles = [
            chunk.register_forward_hook(partial(self._record, c), with_kwargs=True)
            for c, chunk in enumerate(self.chunks)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.rows_of.clear()

    def _record(self, c: int, module, args, kwargs, output) -> None:
        routers, columns = self.per_chunk[c]
        if not routers:
            return
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        rows = self.rows_of[id(mask)][1]
        routes = torch.stack(
            [router.router_replay.recorded_topk_idx for router in routers], dim=1
        ).to(torch.int32)  # [n (/ tp under SP), l, topk]
        if self.sp_group is not None:  # the TP ranks' contiguous shards, in rank order
            shards = [torch.empty_like(routes) for _ in range(self.sp_group.size())]
            torch.distributed.all_gather(shards, routes.contiguous(), group=self.sp_group)
            routes = torch.cat(shards)
        key = self._key(rows)
        if key not in self.tables:
            self.tables[key] = torch.zeros(
                (rows.tree.padded_length, len(self.routers), self.topk),
                dtype=torch.int16,
                device=routes.device,
            )
        positions = rows.positions.to(routes.device)
        self.tables[key][positions[:, None], columns.to(routes.device)[None]] = routes.to(
            torch.int16
        )

    def gather(self, micro_batches, cp_group) -> None:
        """Every CP rank's rows' routes in every table of ``micro_batches`` (in their order, the
        same on every CP rank)."""
        if not self.routers:
            return
        for key, mb in {self._key(mb.rows): mb for mb in micro_batches}.items():
            table = self.tables.get(key)
            if table is None:  # no row of this tree here
                shape = (mb.rows.tree.padded_length, len(self.routers), self.topk)
                table = torch.zeros(shape, dtype=torch.int16, device=mb.input_ids.device)
            summed = table.to(torch.int32)
            torch.distributed.all_reduce(summed, group=cp_group)
            self.tables[key] = summed.to(torch.int16)

    def samples(self, mb) -> torch.Tensor:
        """The routes of the samples ending in ``mb``, nested [b, j, L, topk] (int16, CPU, as
        verl records them)."""
        tree = mb.tree
        lengths = tree.cu_seqlens.diff().tolist()
        if not self.routers:
            return nested([torch.zeros((n, 0, self.topk), dtype=torch.int16) for n in lengths])
        table = self.tables[self._key(mb.rows)]
        per_token = table[tree.token_index.to(table.device)]
        return nested(list(per_token.cpu().split(lengths)))


@dataclass(frozen=True)
class _RecordingContext(StepContext):
    """The step's context in verl's R2 record pass: each micro-batch's tree mask is handed to the
    recorder with its rows, so that each chunk's forward hook knows the rows it ran
    (:class:`_RouteRecorder`)."""

    recorder: _RouteRecorder | None = None

    def model_inputs(self, index, mb, store):
        inputs = super().model_inputs(index, mb, store)
        self.recorder.expect(inputs[2], mb.rows)
        return inputs


class _TreeEngine:
    """What the tree engines change in verl's Megatron engine (see the module docstring).

    Attributes (class level; override per instance): ``tree_backend`` (TreeCoreAttention backend),
    ``tree_block_size`` (packing alignment), ``tree_max_tokens`` (a micro-batch's capacity; None:
    the batch's ``max_token_len_per_gpu`` times the CP size, rounded up to the block size),
    ``tree_share_trunks`` (trunk reuse for prompt groups larger than a micro-batch).
    """

    tree_backend = "auto"
    tree_stats: dict | None = (
        None  # the last batch's packing: sequences, trees, tokens unpacked / computed
    )
    tree_block_size = 128
    tree_max_tokens: int | None = None
    tree_share_trunks = True

    def _build_tf_config(self):
        with _tree_bridges(self.tree_backend):
            return super()._build_tf_config()

    def _build_megatron_module(self):
        with _tree_bridges(self.tree_backend):
            return super()._build_megatron_module()

    def _capacity(self, data, align: int) -> int:
        """A tree's token capacity: ``tree_max_tokens``, or verl's ``max_token_len_per_gpu`` times
        the CP size (verl's own micro-batches hold that many tokens under CP, each rank a share),
        rounded up to the block size and ``align``."""
        tokens = self.tree_max_tokens
        if tokens is None:
            tokens = tu.get_non_tensor_data(data, key="max_token_len_per_gpu", default=None)
            if tokens is not None:
                tokens = int(tokens) * mpu.get_context_parallel_world_size()
        return tree_capacity(
            tokens,
            block_size=self.tree_block_size,
            align=align,
            setting="max_token_len_per_gpu on the batch or tree_max_tokens on the engine",
        )

    def _check_supported(self, data) -> None:
        if getattr(self.engine_config, "dynamic_context_parallel", False):
            raise ValueError(
                "dynamic_context_parallel=True: verl's dynamic CP scheduler re-lays samples per "
                "DPxCP rank, which tree micro-batches replace; set dynamic_context_parallel=False "
                "and context_parallel_size (the tree engine splits every tree across the CP ranks "
                "by attention work)"
            )

    def _routes_to_replay(self, data, forward_only: bool) -> torch.Tensor | None:
        """The routes the batch's trees replay (per sample, nested [B, j, layers, topk]), as verl's
        engine replays them, or None: routing replay off, or verl's R2 record pass (old log-probs
        without ``routed_experts``: the routers record, :class:`_RouteRecorder`).

        R2 replays the recorded routes at every token. R3 replays the rollout's routes at every
        token but a sample's last (verl's replay mask: that row predicts nothing, and the rollout
        records no route for it), whose route is the model's own (-1 here); a sample without
        response tokens replays none. The layers are the model's: a route table of the MoE layers
        only (verl's R2 record on a model with dense layers) is spread to their layer numbers."""
        mode = self.engine_config.router_replay.mode
        if mode == "disabled" or not tu.get_non_tensor_data(
            data, key="enable_routing_replay", default=False
        ):
            return None
        routes = data.get(ROUTE_KEY, None)
        if routes is None:
            if forward_only and mode == "R2":
                return None  # verl's R2 record pass
            raise ValueError(
                f"router_replay.mode={mode!r} replays data[{ROUTE_KEY!r}], which the batch does "
                "not hold: R2 records it in compute_log_prob (forward only), R3 takes the "
                "rollout's (enable_rollout_routing_replay=True)"
            )
        lengths = data["input_ids"].offsets().diff().tolist()
        replayed = lengths
        if mode == "R3":
            responses = data["response_mask"].sum(dim=-1).tolist()
            replayed = [n - 1 if r > 0 else 0 for n, r in zip(lengths, responses)]
        layers = _moe_layers(self.tf_config)
        per_sample = []
        for i, (sample, n, k) in enumerate(zip(routes.unbind(), lengths, replayed)):
            if sample.shape[0] not in (n, n - 1) or sample.shape[0] < k:
                raise ValueError(
                    f"data[{ROUTE_KEY!r}] sample {i} has {sample.shape[0]} routes for {n} tokens; "
                    "give one per token (R3: the last token's may be missing)"
                )
            full = sample.new_full((n, self.tf_config.num_layers, sample.shape[-1]), -1)
            if sample.shape[1] == self.tf_config.num_layers:
                full[:k] = sample[:k]
            elif sample.shape[1] == len(layers):
                full[:k, layers] = sample[:k]
            else:
                raise ValueError(
                    f"data[{ROUTE_KEY!r}] holds routes of {sample.shape[1]} layers; the model has "
                    f"{self.tf_config.num_layers} layers, {len(layers)} of them MoE layers"
                )
            per_sample.append(full)
        return nested(per_sample)

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        self._check_supported(data)
        config = self.tf_config
        # Packed lengths divide by the CP size (times the TP size under sequence parallelism);
        # constant shapes where the step needs them (pipeline stages, the allgather dispatcher).
        align = config.context_parallel_size * (
            config.tensor_model_parallel_size if config.sequence_parallel else 1
        )
        constant = _needs_constant_shapes(config, len(self.module))
        # the batch's packing, from verl's micro-batch preparation to its schedule call
        trees: dict = {}
        prepare = partial(
            self._prepare_trees,
            capacity=self._capacity(data, align),
            align=align,
            constant=constant,
            trees=trees,
            routes=self._routes_to_replay(data, forward_only),
        )
        schedule = partial(
            self._tree_schedule, trees=trees, loss_function=loss_function, forward_only=forward_only
        )
        tu.assign_non_tensor(
            data, use_dynamic_bsz=True
        )  # verl then restores the order from our indices
        with swapped(
            transformer_impl,
            prepare_micro_batches=prepare,
            get_forward_backward_func=lambda: schedule,
            reorder_and_merge_vpp_layers=_merged_routes,
        ):
            return super().forward_backward_batch(data, loss_function, forward_only)

    def _prepare_trees(
        self,
        data,
        dp_group=None,
        num_batches_divided_by=None,
        *,
        capacity: int,
        align: int,
        constant: bool,
        trees: dict,
        routes: torch.Tensor | None,
        **unused,
    ):
        # With dp_group every data-parallel rank gets as many micro-batches (all-padding ones
        # appended), as Megatron's schedule and verl's same_micro_num_in_dp need; the ranks of a
        # pipeline and of a CP group pack the same data the same way.
        micro_batches, indices, packed = tree_micro_batches(
            data,
            max_tokens=capacity,
            block_size=self.tree_block_size,
            share_trunks=self.tree_share_trunks,
            dp_group=dp_group,
            parallel_size=align,
            pad_to_max=constant,
            routes=routes,
        )
        self.tree_stats = log_packing(packed)
        # Each CP rank computes its share of every micro-batch's rows (split on the host).
        cp_group = (
            mpu.get_context_parallel_group() if mpu.get_context_parallel_world_size() > 1 else None
        )
        packed = split_for_context_parallel(packed, cp_group)
        temperature = sample_temperatures(data)
        trees["replay"] = routes is not None
        trees["packed"], trees["token_rows"] = (
            packed,
            [  # the head's host facts, once per micro-batch
                (
                    _TokenRows.of(mb.tree, mb.rows, temperature) if mb.tree.num_sequences else None,
                    _TokenRows.of(mb.rows.tree, mb.rows, temperature) if mb.rows.records else None,
                )
                for mb in packed
            ],
        )
        if num_batches_divided_by:
            # verl asserts that its micro-batch count divides by the interleaved schedule's group
            # size; the tree schedule rounds each of its calls itself (all-padding fill-ins), so
            # these extra entries (copies of the last) are never run.
            extra = -len(micro_batches) % num_batches_divided_by
            micro_batches += [micro_batches[-1]] * extra
        return micro_batches, indices

    def _token_share(self, data) -> torch.Tensor:
        """Per-token mode under CP: this CP rank's share of a micro-batch's routed tokens, the
        remainder dealt to the first ranks (verl's ``tokens // cp`` on every rank would count up
        to cp - 1 tokens fewer per micro-batch), so that the shares add up to the tokens."""
        routed = self._routed_num_tokens(data)
        size = mpu.get_context_parallel_world_size()
        return (routed // size + (routed % size > mpu.get_context_parallel_rank())).to(torch.int)

    def _tree_schedule(
        self,
        forward_step_func,
        data_iterator,
        model,
        num_microbatches,
        *,
        trees: dict,
        loss_function,
        forward_only,
        **unused,
    ) -> list[dict]:
        """In place of Megatron's ``forward_backward_func`` (verl's forward step is not used): the
        tree step's loops over the batch's micro-batches, returning verl's outputs of those that
        take a loss, in micro-batch order (as verl's indices list them); on other pipeline stages
        than the last, none (verl's engine then returns no output there, as its own does)."""
        device = next(model[0].parameters()).device
        # Under virtual pipeline parallelism verl hands one iterator per model chunk.
        batches = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
        micro_batches = [batch.to(device) for batch in batches]
        packed = trees["packed"].to(device)
        token_rows = [
            tuple(None if t is None else t.to(device) for t in pair) for pair in trees["token_rows"]
        ]
        flags = {
            k: tu.get_non_tensor_data(micro_batches[0], key=k, default=False)
            for k in (
                "calculate_sum_pi_squared",
                "calculate_entropy",
                "distillation_use_topk",
                "distillation_only",
            )
        }
        phases = Phases.of(list(packed))
        if flags["distillation_use_topk"] and (
            phases.trunks or mpu.get_context_parallel_world_size() > 1
        ):
            raise ValueError(
                "top-k distillation reads the teacher's per-token data in the micro-batch's order, "
                "which trunk parts and context-parallel row shares do not keep: set "
                "tree_share_trunks=False on the engine and context_parallel_size=1"
            )
        record = None
        if tu.get_non_tensor_data(micro_batches[0], key="record_r2_routes", default=False):
            config = self.tf_config
            sp = config.sequence_parallel and config.tensor_model_parallel_size > 1
            record = _RouteRecorder(
                model,
                config.moe_router_topk,
                mpu.get_tensor_model_parallel_group() if sp else None,
            )
        head = _VerlHead(
            partial(
                self._tree_head, loss_function=loss_function, flags=flags, batch=micro_batches[0]
            ),
            {id(mb.rows): pair for mb, pair in zip(packed, token_rows)},
        )
        per_token = bool(self.tf_config.calculate_per_token_loss)
        loss = _VerlLoss(
            micro_batches,
            [None if own is None else own.lengths for own, _ in token_rows],
            partial(
                self.postprocess_micro_batch_func,
                forward_only=forward_only,
                loss_function=loss_function,
            ),
            self._tree_model_output,
            self._token_share if per_token and mpu.get_context_parallel_world_size() > 1 else None,
        )
        if trees["replay"]:
            check_replaying(model, ROUTE_KEY)
        ctx = (StepContext if record is None else partial(_RecordingContext, recorder=record))(
            model,
            self.tf_config,
            moe=bool(self.tf_config.num_moe_experts),
            routes=replay_routes(list(packed), ROUTE_KEY) if trees["replay"] else None,
            # expert-parallel ranks (data-parallel ones) run as many micro-batches per call
            ep_group=mpu.get_data_parallel_group() if expert_parallel(self.tf_config) else None,
            # Per-token mode: router losses weighted by their tokens, as the loss's (Megatron
            # divides both by the global token count); otherwise Megatron's mean per micro-batch.
            loss_scale=1.0 if per_token else None,
            per_token=False,  # the config's mode: verl's protocol
        )
        with (
            _vpp_groups_of_pp(model),
            replaying(model) if trees["replay"] else contextlib.nullcontext(),
            contextlib.nullcontext() if record is None else record.recording(),
        ):
            run_phases(ctx, list(packed), head, loss, forward_only=forward_only, phases=phases)
        if record is not None:
            if mpu.get_context_parallel_world_size() > 1:
                record.gather(list(packed), mpu.get_context_parallel_group())
            # verl's engine gathers these over the pipeline stages (per micro-batch taking a loss,
            # in its order; each holds all this stage's layers, every model chunk's, so verl's
            # per-chunk reordering under VPP is skipped, _merged_routes) and restores the batch's
            # sample order with our indices, as it does with its own recordings.
            self.mini_layer_topk_idx_list += [
                record.samples(mb) for mb in packed if mb.tree.num_sequences
            ]
        return [loss.outputs[i] for i in sorted(loss.outputs)]


def _merged_routes(micro_batch_routes, *unused) -> torch.Tensor:
    """In place of verl's ``reorder_and_merge_vpp_layers`` (its R2 record under VPP keeps one
    table per micro-batch and model chunk, in the interleaved schedule's order): the tree engine's
    tables hold every chunk of this stage per micro-batch, in layer order already
    (:class:`_RouteRecorder`), so they are only merged, as verl does without VPP."""
    return transformer_impl.merge_nested_router_maps(micro_batch_routes)


def _moe_layers(config) -> list[int]:
    """The 0-based indices of ``config``'s MoE layers (``moe_layer_freq``: every n-th layer, or a
    0/1 list per layer)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i for i in range(config.num_layers) if i % freq == 0]
    return [i for i, moe in enumerate(freq) if moe]


def _recording_routers(chunks) -> list:
    """The routers that record routes (verl's ``RouterReplay`` on them), in layer order."""
    routers = [
        m.router
        for chunk in chunks
        for m in chunk.modules()
        if getattr(getattr(m, "router", None), "router_replay", None) is not None
    ]
    return sorted(routers, key=lambda router: router.layer_number)


def _needs_constant_shapes(config, num_chunks: int) -> bool:
    """Whether every tree is padded to the capacity: where the package's step needs one length
    (:func:`~megatron_tree.mcore.step.constant_shapes`: pipeline stages, the allgather expert
    dispatcher), except the one-chunk pipeline of a config with ``variable_seq_lengths`` (both of
    verl's model paths set it): its stages send each activation's shape first, one direction per
    exchange. The interleaved schedule's shape exchange posts both directions in one batch, which
    gloo mismatches (tried: PP=2 x VPP=2 with trees of 64 and 48 rows fails on gloo), so virtual
    pipelines keep one length."""
    if constant_shapes(config) is None:
        return False
    allgather = expert_parallel(config) and config.moe_token_dispatcher_type == "allgather"
    return allgather or num_chunks > 1 or not config.variable_seq_lengths


@contextlib.contextmanager
def _vpp_groups_of_pp(model):
    """Under virtual pipeline parallelism: the interleaved schedule's micro-batch groups of the
    pipeline size, for which :func:`~megatron_tree.mcore.schedule.run_phases` rounds each call's
    micro-batch count (a larger ``microbatch_group_size_per_vp_stage`` only reorders the
    schedule, and Megatron refuses counts below it)."""
    if len(model) == 1:
        yield
        return
    config = get_model_config(model[0])
    with swapped(
        config,
        microbatch_group_size_per_vp_stage=mpu.get_pipeline_model_parallel_world_size(),
    ):
        yield


@EngineRegistry.register(
    model_type="language_model", backend="megatron", device=["cuda", "cpu"], vendor=VENDOR
)
class TreeMegatronEngineWithLMHead(_TreeEngine, MegatronEngineWithLMHead):
    """verl's ``MegatronEngineWithLMHead`` with tree micro-batches and tree attention (the actor
    and the reference policy)."""

    def _tree_head(self, logits, token_rows: _TokenRows, *, loss_function, flags, batch) -> dict:
        """verl's logits processor at ``token_rows``' tokens: logits [1, n, V / tp] -> per-token
        outputs [T] (log_probs, entropy, ... as verl computes them)."""
        out = self._lm_head_logits_processor(
            logits[:, token_rows.rows],
            token_rows.labels[None],
            token_rows.temperature[None].clone(),
            logits_processor_func=loss_function,
            batch=batch,
            data_format="thd",
            **flags,
        )
        return {k: token_rows.scatter(v[0]) for k, v in out.items()}

    @staticmethod
    def _tree_model_output(per_sample: dict) -> dict:
        return per_sample  # as verl's forward step: {log_probs, entropy, ...: nested [b, j]}


@EngineRegistry.register(
    model_type="value_model", backend="megatron", device=["cuda", "cpu"], vendor=VENDOR
)
class TreeMegatronEngineWithValueHead(_TreeEngine, MegatronEngineWithValueHead):
    """verl's ``MegatronEngineWithValueHead`` with tree micro-batches and tree attention (the
    critic): each sample's values are the value head's output at its own tokens' rows."""

    def _tree_head(self, values, token_rows: _TokenRows, **unused) -> dict:
        """values [1, n, 1] -> per-token values [T]."""
        return {"values": token_rows.scatter(values[0, token_rows.rows, 0])}

    @staticmethod
    def _tree_model_output(per_sample: dict) -> torch.Tensor:
        return per_sample["values"]  # as verl's value forward step: the values, nested [b, j]
