"""What every engine adapter decides the same way (verl Megatron / FSDP, AReaL Megatron / FSDP, the
FSDP2 helper): a tree's token capacity, the packing report and the refusal of Ulysses sequence
parallelism. No framework or Megatron import: the FSDP / HF adapters import it too."""

from __future__ import annotations

import logging
import math

from ..core.batch import PackedTreeBatch

logger = logging.getLogger(__name__)


def tree_capacity(tokens: int | None, *, block_size: int, align: int = 1, setting: str) -> int:
    """A tree's unique-token capacity: ``tokens`` rounded up to a multiple of the block size and
    ``align`` (the CP size, times the TP size under sequence parallelism), logged when rounded.

    Args:
        tokens: the framework's token budget of one micro-batch (None: not set).
        block_size: the attention tile every packed length is a multiple of.
        align: another factor of every packed length.
        setting: where the user sets ``tokens`` (named in the error when it is None).
    """
    if tokens is None:
        raise ValueError(
            "tree micro-batches need a token capacity (the unique tokens of one tree): set "
            f"{setting}"
        )
    unit = math.lcm(block_size, align)
    capacity = math.ceil(int(tokens) / unit) * unit
    if capacity != tokens:
        logger.info(
            "megatron_tree: token capacity %d rounded up to %d (a multiple of the block size %d "
            "and the CP x SP alignment %d)",
            tokens,
            capacity,
            block_size,
            align,
        )
    return capacity


def log_packing(packed: PackedTreeBatch) -> dict:
    """A packed batch's statistics (what an engine keeps as ``tree_stats``), logged in one line."""
    logger.info("megatron_tree: %s", packed.summary_line())
    return packed.summary()


def refuse_ulysses(setting: str, size: int) -> None:
    """Refuse Ulysses sequence parallelism (``setting`` = ``size`` other than 1): a tree's attention
    is not split over ranks by heads."""
    if size != 1:
        raise ValueError(
            f"{setting}={size}: tree training does not split a tree over Ulysses sequence-parallel "
            f"ranks (heads all-to-all); set {setting}=1 and give those ranks to data parallelism "
            "(for long sequences, the Megatron engines' context parallelism splits a tree)"
        )
