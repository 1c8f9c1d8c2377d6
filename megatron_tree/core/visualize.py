"""A picture of a packed tree's attention mask, written as PNG with the standard library only.

The picture is drawn at tile level from the O(N) encoding (``tree_block_layout``), so a 32K-token
tree costs (N / tile)^2 pixels of work, never N^2: each pixel is one (query tile, key tile) pair,
dark where every pair in the tile attends, mid-tone where some do, white where none do.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import torch

from .mask import tree_block_layout
from .tree import PackedTree

_FULL, _PARTIAL, _EMPTY, _PAD = (31, 78, 140), (140, 178, 224), (255, 255, 255), (235, 235, 235)


def _write_png(path: Path, rgb: torch.Tensor) -> None:
    """rgb: uint8 [H, W, 3]."""
    height, width, _ = rgb.shape
    rows = torch.cat([torch.zeros(height, 1, dtype=torch.uint8), rgb.reshape(height, -1)], dim=1)

    def chunk(kind: bytes, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = zlib.compress(rows.numpy().tobytes(), 6)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def save_tree_mask_png(tree: PackedTree, path: str | Path, *, max_pixels: int = 1024) -> Path:
    """Write the tree's attention mask as a PNG, one pixel per tile of tokens.

    Args:
        tree: the packed tree.
        path: output file.
        max_pixels: largest image edge; the tile edge is the smallest divisor of N that fits.

    Returns:
        The path written. Rows are queries, columns keys; padding rows/columns are light grey.
    """
    n = tree.padded_length
    tile = next(t for t in range(1, n + 1) if n % t == 0 and n // t <= max_pixels)
    any_allowed, all_allowed = tree_block_layout(tree, tile)
    colour = torch.tensor([_EMPTY, _PARTIAL, _FULL, _PAD], dtype=torch.uint8)
    index = any_allowed.long() + all_allowed.long()
    pad_tiles = torch.arange(n // tile) * tile >= tree.num_tree_tokens
    index[pad_tiles[:, None] | pad_tiles[None, :]] = 3
    index[any_allowed & (pad_tiles[:, None] | pad_tiles[None, :])] = 1
    # Upscale small pictures so a person can see them.
    scale = max(1, 256 // (n // tile))
    image = colour[index].repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    path = Path(path)
    _write_png(path, image.contiguous())
    return path
