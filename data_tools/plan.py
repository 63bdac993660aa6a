"""Which shards each replica and DataLoader worker reads: explicit node and worker splitters.

    from data_tools.plan import resolve_replica, split_round_robin
    rank, world = resolve_replica(*rt.data_split())   # what labkit's runtime says (make_loader(rank=, world_size=))
    mine = split_round_robin(range(64), rank, world)

webdataset's default node splitter reads RANK/WORLD_SIZE, which torch_xla's launchers do not set
(every core would read every shard), so the split is made explicitly: the caller passes (rank, world_size) from
labkit's runtime (Runtime.data_split: the replica, or the SPMD host); data_tools cannot import labkit's
training path, so it takes the numbers, not the object. Only when none are given does it read the launchers' globals.
"""

from __future__ import annotations

import math
import os
import sys

import braceexpand
import torch


def resolve_replica(rank=None, world_size=None) -> tuple[int, int]:
    """(rank, world_size): the explicit args (labkit passes its Runtime's data_split()), else torch_xla's runtime
    when this process uses XLA, else torch.distributed, else (0, 1)."""
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ValueError(f"pass both rank and world_size (got rank={rank}, world_size={world_size})")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        return int(rank), int(world_size)
    # the default, for data_tools used on its own (no numbers from labkit's runtime): the launchers' globals. This
    # repeats what labkit.runtime's data_split knows, because data_tools may not import it (pyproject's layers)
    if "torch_xla.runtime" in sys.modules and os.environ.get("PJRT_DEVICE"):  # xmp.spawn sets no RANK
        xr = sys.modules["torch_xla.runtime"]
        if xr.is_spmd():  # one process drives every local chip: hosts are the replicas
            return xr.process_index(), xr.process_count()
        return xr.global_ordinal(), xr.world_size()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def expand_urls(source) -> list[str]:
    """A brace pattern ("dir/train-{000000..000003}.tar"), or a list of them, -> list of URLs."""
    items = [source] if isinstance(source, str) else list(source or [])
    urls = [u for s in items for u in braceexpand.braceexpand(str(s))]
    if not urls:
        raise ValueError("no shard URLs given (empty list); pass a manifest.json or shard URLs")
    return urls


def split_round_robin(seq, index: int, count: int) -> list:
    """Round-robin share `index` of `count` (the explicit node and worker splitter)."""
    return list(seq[index::count])


def allocate(total: int, weights: list[float]) -> list[int]:
    """Split integer `total` proportionally to `weights` (largest remainders), summing to `total`."""
    s = sum(weights)
    ideal = [total * w / s for w in weights] if s > 0 else [total / len(weights)] * len(weights)
    out = [int(math.floor(v)) for v in ideal]
    for i in sorted(range(len(ideal)), key=lambda i: (out[i] - ideal[i], i))[: total - sum(out)]:
        out[i] += 1
    return out
