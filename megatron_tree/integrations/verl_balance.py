"""verl's single-controller balancing with prompt groups whole, for both tree engines (Megatron
and FSDP); no Megatron import.

verl's ``RayPPOTrainer._balance_batch`` balances sequence lengths and so scatters a prompt's samples
over the data-parallel ranks, where they share nothing. :func:`tree_balance_batch` keeps each
prompt group (``uid``) on one rank; with ``VERL_ENGINE_VENDOR=megatron_tree`` importing this module
(verl's plugin entry point does, inside ``import verl``) installs it as soon as verl's trainer
module is imported (:func:`balance_on_trainer_import`), so the launcher is unchanged.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.abc
import importlib.util
import logging
import os
import sys

import torch
from verl.utils.seqlen_balancing import log_seqlen_unbalance

from ..core.partition import partition_for_data_parallel
from ..core.trie import unique_tokens
from .verl_common import VENDOR

logger = logging.getLogger(__name__)


def balance_prompt_groups(
    sequences: list[torch.Tensor], uids, dp_size: int
) -> list[list[int]] | None:
    """Sample indices per data-parallel rank with every prompt group (samples of one ``uid``) on one
    rank, the same number of samples on every rank (verl's dispatch splits the batch into equal
    chunks) and the ranks' tree tokens balanced: the core's data-parallel balancer,
    :func:`~megatron_tree.core.partition.partition_for_data_parallel`, with ``groups=uids`` and
    ``equal_sizes=True`` (a group joining a rank that holds its prompt repeats nothing). None when
    the groups cannot fill equal chunks: their number is not a multiple of ``dp_size`` or they
    differ in size."""
    sizes = collections.Counter(uids).values()
    if len(sizes) % dp_size or len(set(sizes)) != 1:
        return None
    ranks = partition_for_data_parallel(
        {"input_ids": list(sequences)}, dp_size, groups=list(uids), equal_sizes=True
    )
    return [rank.tolist() for rank in ranks]


def tree_balance_batch(original):
    """``RayPPOTrainer._balance_batch`` for tree training: verl balances sequence lengths and so
    scatters a prompt's samples over the data-parallel ranks, where they share nothing; this keeps
    each prompt group (``uid``) on one rank and balances the ranks' tree tokens
    (:func:`balance_prompt_groups`, per mini-batch with ``keep_minibatch``). Falls back to verl's
    balancing, with a warning, when the groups cannot fill equal chunks."""

    @functools.wraps(original)
    def balance(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        def verls(reason: str):
            logger.warning(
                "megatron_tree: %s; verl's sequence-length balancing is used (prompt groups may be "
                "split over data-parallel ranks, where they share nothing)",
                reason,
            )
            return original(
                self, batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch
            )

        uids = batch.non_tensor_batch.get("uid")
        if uids is None:
            return verls("the batch has no 'uid' (prompt group) entries")
        dp_size = self._get_dp_size(self.actor_rollout_wg, "actor")
        mask = batch.batch["attention_mask"].bool()
        size = mask.shape[0]
        sequences = [batch.batch["input_ids"][i][mask[i]] for i in range(size)]
        step = (
            self.config.actor_rollout_ref.actor.get("ppo_mini_batch_size")
            if keep_minibatch
            else size
        )
        parts = [[] for _ in range(dp_size)]
        for start in range(0, size, step):
            chunk = balance_prompt_groups(
                sequences[start : start + step], uids[start : start + step], dp_size
            )
            if chunk is None:
                return verls(
                    f"the prompt groups (uid) cannot fill {dp_size} equal data-parallel chunks"
                )
            for rank, members in enumerate(chunk):
                parts[rank] += [start + i for i in members]
        batch.reorder(torch.tensor([i for part in parts for i in part]))
        lengths = mask.sum(-1).tolist()
        metrics.update(
            log_seqlen_unbalance(seqlen_list=lengths, partitions=parts, prefix=logging_prefix)
        )
        tokens = [unique_tokens([sequences[i] for i in part]) for part in parts]
        metrics[f"{logging_prefix}/tree_tokens_max_rank"] = max(tokens)
        metrics[f"{logging_prefix}/tree_tokens_min_rank"] = min(tokens)

    balance.megatron_tree = True
    return balance


TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"


def patch_trainer_balancing(*, how: str = "patch_trainer_balancing() called") -> None:
    """Replace ``RayPPOTrainer._balance_batch`` by :func:`tree_balance_batch` (once) and log one
    line saying so (``how``: what applied it).

    With ``VERL_ENGINE_VENDOR=megatron_tree`` this is not needed: importing this module (the verl
    plugin does, inside ``import verl``) sets :func:`balance_on_trainer_import`, which applies it as
    soon as verl's trainer module has been imported. Call it yourself only where the vendor variable
    is not set in the process that runs verl's trainer (the driver's ``TaskRunner``) while the
    workers get it some other way, or where verl's plugins are off (``VERL_USE_EXTERNAL_PLUGINS``).
    Importing verl's trainer from the plugin would be circular (the plugin runs inside ``import
    verl``) and would pull its rollout stack into every worker, hence the import hook."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    if not getattr(RayPPOTrainer._balance_batch, "megatron_tree", False):
        RayPPOTrainer._balance_batch = tree_balance_batch(RayPPOTrainer._balance_batch)
        logger.info(
            "megatron_tree: verl's RayPPOTrainer._balance_batch keeps prompt groups on one "
            "data-parallel rank (%s)",
            how,
        )


class _AfterImport(importlib.abc.MetaPathFinder):
    """One-shot import hook: after the module ``name`` has been executed (by whichever finder and
    loader would import it anyway), call ``then(module)``; an error there is logged, never raised
    into the import."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)  # once; and so the lookup below does not come back here
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module):
            exec_module(module)
            try:
                then(module)
            except Exception:
                logger.exception("megatron_tree: the hook after importing %s failed", fullname)

        spec.loader.exec_module = exec_then
        return spec


def balance_on_trainer_import(environ=os.environ) -> str:
    """With ``VERL_ENGINE_VENDOR=megatron_tree`` in ``environ``: :func:`patch_trainer_balancing` as
    soon as verl's trainer module (``verl.trainer.ppo.ray_trainer``) is imported (at once if it
    already is), so no launcher edit is needed. The hook is Python's import system: verl 0.9.1 has
    none that reaches the tokens. Its trainer's group-keeping branch (``use_prefix_grouper`` in the
    actor config, a config edit) hands its balancing function lengths and uids only (the tree's
    shared tokens are not visible there), and the partition function it imports by name
    (``get_seqlen_balanced_partitions``) gets workloads only, without uids. Returns what is
    active: ``"hook"``, ``"patched"`` or ``"verl"`` (vendor unset: verl's own balancing)."""
    if environ.get("VERL_ENGINE_VENDOR") != VENDOR:
        return "verl"
    how = f"VERL_ENGINE_VENDOR={VENDOR}, set on importing {TRAINER_MODULE}"
    if TRAINER_MODULE in sys.modules:
        patch_trainer_balancing(how=how)
        return "patched"
    if not any(
        isinstance(finder, _AfterImport) and finder.name == TRAINER_MODULE
        for finder in sys.meta_path
    ):
        sys.meta_path.insert(
            0, _AfterImport(TRAINER_MODULE, lambda module: patch_trainer_balancing(how=how))
        )
    return "hook"


balance_on_trainer_import()
