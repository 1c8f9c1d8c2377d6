"""A picture of a packed tree's attention mask, drawn with matplotlib (optional dependency; outside
``core``, which imports only torch and numpy).

The picture is drawn at tile level from the O(N) encoding (``tree_block_layout``), so a 32K-token
tree costs (N / tile)^2 pixels of work, never N^2: each pixel is one (query tile, key tile) pair,
dark where every pair in the tile attends, mid-tone where some do, white where none do, light grey
for padding.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.mask import tree_block_layout
from ..core.tree import PackedTree

EMPTY, PARTIAL, FULL, PAD = 0, 1, 2, 3
_COLOURS = ("#ffffff", "#8cb2e0", "#1f4e8c", "#ebebeb")  # indexed by EMPTY, PARTIAL, FULL, PAD
_LABELS = ("none attend", "some attend", "all attend", "padding")


def tree_mask_tiles(tree: PackedTree, max_pixels: int = 1024) -> tuple[torch.Tensor, int]:
    """The mask picture's pixel grid: one pixel per (query tile, key tile).

    Args:
        tree: the packed tree, N = ``tree.padded_length`` tokens.
        max_pixels: largest grid edge; the tile edge is the smallest divisor of N with
            N / tile <= max_pixels.

    Returns:
        (grid, tile): grid is uint8 [N / tile, N / tile], rows query tiles, columns key tiles,
        holding EMPTY / PARTIAL / FULL (no / some / every pair of the tile allowed) or PAD (a
        padding row or column with no allowed pair; one with some is PARTIAL).
    """
    n = tree.padded_length
    tile = next(t for t in range(1, n + 1) if n % t == 0 and n // t <= max_pixels)
    any_allowed, all_allowed = tree_block_layout(tree, tile)
    grid = any_allowed.to(torch.uint8) + all_allowed.to(torch.uint8)
    pad_tiles = torch.arange(n // tile) * tile >= tree.num_tree_tokens
    pad = pad_tiles[:, None] | pad_tiles[None, :]
    grid[pad] = PAD
    grid[pad & any_allowed] = PARTIAL
    return grid, tile


def save_tree_mask_png(tree: PackedTree, path: str | Path, *, max_pixels: int = 1024) -> Path:
    """Write the tree's attention mask as a PNG (matplotlib, Agg), one image pixel per tile.

    Args:
        tree: the packed tree, N = ``tree.padded_length`` tokens.
        path: output file (its folder is created).
        max_pixels: largest edge of the tile grid (see :func:`tree_mask_tiles`).

    Returns:
        The path written. Rows are queries, columns keys, both in token positions 0..N.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(
            "save_tree_mask_png needs matplotlib: pip install matplotlib (or pip install "
            "megatron_tree[examples])"
        ) from e
    grid, tile = tree_mask_tiles(tree, max_pixels)
    n, side = tree.padded_length, grid.shape[0]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The axes span ~4.5 of the figure's 6 inches: at least one screen pixel per tile.
    fig, ax = plt.subplots(figsize=(6.5, 6), dpi=max(100, -(-side // 4)))
    ax.imshow(
        grid.numpy(),
        cmap=ListedColormap(_COLOURS),
        vmin=0,
        vmax=3,
        interpolation="nearest",
        extent=(0, n, n, 0),
    )
    ax.set(
        xlabel="key position",
        ylabel="query position",
        title=f"tree attention mask: {tree.num_tree_tokens} tokens (padded {n}), tile {tile}",
    )
    patches = [Patch(facecolor=c, edgecolor="grey", label=s) for c, s in zip(_COLOURS, _LABELS)]
    ax.legend(handles=patches, loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
