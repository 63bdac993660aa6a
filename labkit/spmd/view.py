"""A picture of how tensors are laid out over devices: one row per strategy, one panel per tensor.

    fig = draw_layouts([{"strategy": "tensor", "devices": 8, "tensors": [
        ("mlp.fc.weight", (128, 32), "{devices=[2,1,4]0,2,4,6,1,3,5,7 last_tile_dim_replicate}"),
        ("batch (B, T)", (16, 16), "{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}")]}])
    fig.savefig("layouts.png")

Draws from plain data (shapes and XLA sharding strings, as labkit.spmd.sharding.layout_table and
sharding_of give them): each tile of a tensor is a rectangle in proportion to its slice, coloured
by the first device holding it and labelled with every device that holds a copy.
"""

from __future__ import annotations

from labkit.spmd.sharding import tile_devices

REPLICATED = (0.85, 0.85, 0.85)  # the light grey of a tile every device holds


def _label(ids: list[int], devices: int) -> str:
    if not ids or len(ids) == devices:
        return f"all {devices}" if devices > 1 else "device 0"
    return "dev " + ",".join(map(str, ids))


def draw_tensor(ax, name: str, shape: tuple, spec: str, devices: int):
    """One 2-D tensor (1-D ones drawn as a row) split into its tiles."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    shape = tuple(shape) if len(shape) >= 2 else (1,) + tuple(shape)
    rows, cols = shape[0], shape[1]
    tiles = tile_devices(2, spec)
    nr = 1 + max(i for i, _ in tiles)
    nc = 1 + max(j for _, j in tiles)
    # tab10 without its grey (index 7): grey means "every device holds it", so no single device may be drawn grey
    palette = [c for k, c in enumerate(plt.get_cmap("tab10").colors) if k != 7]
    for (i, j), ids in tiles.items():
        h, w = rows / nr, cols / nc
        colour = palette[ids[0] % len(palette)] if ids and len(ids) < devices else REPLICATED
        ax.add_patch(Rectangle((j * w, rows - (i + 1) * h), w, h, facecolor=colour, edgecolor="black", lw=0.8))
        tall = w / cols < h / rows  # narrow column tiles: label along the tile
        ax.text(
            j * w + w / 2,
            rows - (i + 0.5) * h,
            _label(ids, devices),
            ha="center",
            va="center",
            fontsize=7,
            rotation=90 if tall else 0,
        )
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(f"{name} {tuple(shape)}", fontsize=8)


def draw_layouts(panels: list[dict], figsize_per=(2.6, 2.2)):
    """panels: [{"strategy", "devices", "mesh" (optional text), "tensors": [(name, shape, spec), ...]}].
    Returns the matplotlib Figure (one row per strategy)."""
    import matplotlib.pyplot as plt

    ncols = max(len(p["tensors"]) for p in panels)
    fig, axes = plt.subplots(
        len(panels), ncols, figsize=(figsize_per[0] * ncols, figsize_per[1] * len(panels)), squeeze=False
    )
    for r, p in enumerate(panels):
        for c in range(ncols):
            ax = axes[r][c]
            if c >= len(p["tensors"]):
                ax.axis("off")
                continue
            name, shape, spec = p["tensors"][c]
            draw_tensor(ax, name, shape, spec, p["devices"])
        axes[r][0].set_ylabel(f"{p['strategy']}\n{p.get('mesh', '')}", fontsize=9)
    fig.tight_layout()
    return fig
