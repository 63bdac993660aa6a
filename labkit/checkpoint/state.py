"""What a checkpoint file holds, and the checks on the way back in.

    cpu_state = to_cpu(trainer.state_dict(), rt)   # one batched device->host copy; plain types only
    verify(data, "gs://b/run/ckpt-00000100.pt", expect_crc)   # IOError naming the object if damaged
    check_compatible(state["model"], model)        # ValueError naming the first mismatched key

Used by labkit.checkpoint (the manager), labkit.loop (resume) and labkit.serve.export (serving copies).
"""

from __future__ import annotations

import io
import zipfile

import numpy as np
import torch

from labkit.accumulate import to_host
from labkit.cloud import gcs


# -- state conversion ----------------------------------------------------------------------------
def to_cpu(state, rt=None):
    """Copy every tensor of a nested state to the CPU. On XLA all tensors go in one batched
    transfer (what xm.save does), so saving adds no compile and one device->host copy."""
    leaves: list = []

    def collect(o):
        if torch.is_tensor(o):
            leaves.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                collect(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                collect(v)

    collect(state)
    # device tensors: one batched transfer (metrics.to_host: one TransferFromDevice on XLA)
    on_device = [t for t in leaves if t.device.type != "cpu"]
    moved = {id(t): c for t, c in zip(on_device, to_host(on_device))}
    for t in leaves:
        if id(t) not in moved:
            # clone: the trainer keeps updating its CPU tensors in place while the upload runs
            moved[id(t)] = t.detach().to("cpu", copy=True)

    def rebuild(o, path):
        if torch.is_tensor(o):
            return moved[id(o)]
        if isinstance(o, dict):
            return {k: rebuild(v, f"{path}[{k!r}]") for k, v in o.items()}
        if isinstance(o, (list, tuple)) and not isinstance(o, torch.Size):
            return [rebuild(v, f"{path}[{i}]") for i, v in enumerate(o)]  # tuples become lists: weights_only-safe
        if isinstance(o, np.generic):  # e.g. a scheduler's lr computed with np.cos: torch.load(weights_only) refuses it
            return o.item()
        if isinstance(o, np.ndarray):
            return torch.from_numpy(np.array(o))
        if o is None or isinstance(o, _PLAIN):
            return o
        raise TypeError(
            f"{path} is a {type(o).__module__}.{type(o).__qualname__}: a checkpoint holds only tensors, "
            "numbers, strings, lists and dicts (what torch.load(weights_only=True) accepts); "
            "convert it before saving"
        )

    return rebuild(state, "state")


_PLAIN = (bool, int, float, complex, str, bytes, torch.Size, torch.dtype, torch.device)


def check_compatible(model_state: dict, target_model) -> None:
    """Raise ValueError naming the first key whose presence or shape differs."""
    target = target_model.state_dict()
    for k, v in model_state.items():
        if k not in target:
            raise ValueError(f"checkpoint key {k!r} is not in the model ({type(target_model).__name__})")
        if tuple(v.shape) != tuple(target[k].shape):
            raise ValueError(f"shape mismatch at {k!r}: checkpoint {tuple(v.shape)}, model {tuple(target[k].shape)}")
    for k in target:
        if k not in model_state:
            raise ValueError(f"model key {k!r} is missing from the checkpoint")


# -- verification -------------------------------------------------------------------------------
def verify(data: bytes, where: str, expect_crc: str | None = None) -> None:
    """Raise IOError naming `where` unless `data` is an intact torch checkpoint: the whole-object
    crc32c when one was recorded, and the CRC-32 of every zip member (torch writes them; torch.load
    does not check them)."""
    if expect_crc is not None and gcs.crc32c_b64(data) != expect_crc:
        raise OSError(f"crc32c of {where} does not match the one recorded when it was saved")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError) as e:
        raise OSError(f"{where} is not an intact torch checkpoint ({type(e).__name__}: {e})") from None
    if bad is not None:
        raise OSError(f"{where} is corrupt: the CRC-32 of its member {bad!r} does not match")
