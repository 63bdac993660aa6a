"""Seeding and RNG capture: the one home for every random generator labkit touches.

    seeding.manual_seed(0, rt)           # python, numpy, torch (+ the XLA or CUDA generator)
    state = seeding.rng_state(rt)        # weights_only-safe: goes into every checkpoint
    seeding.set_rng_state(state, rt)     # dropout/augmentation draws continue exactly

Each takes the Runtime: which device generator exists is the backend's (labkit.runtime: seed_device,
device_rng_state). Runtime.manual_seed delegates here; the Trainer's state_dict captures rng_state, so a run
resumed from a checkpoint draws the same numbers as one that never stopped.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def manual_seed(seed: int, rt) -> None:
    """Seed python, numpy and torch, plus the XLA generator on XLA or every CUDA device on CUDA."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    rt.seed_device(seed)  # the XLA or CUDA generator (labkit.runtime); nothing more on the CPU


def rng_state(rt) -> dict:
    """Python, numpy, torch (+ XLA or CUDA) generator states as weights_only-safe values."""
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    out.update(rt.device_rng_state())  # {"xla": ...} or {"cuda": ...} (labkit.runtime); {} on the CPU
    return out


def set_rng_state(state: dict, rt) -> None:
    """Put back what rng_state captured (generators absent from `state` are left alone)."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    rt.set_device_rng_state(state)  # the generators of rt's device found in `state`
