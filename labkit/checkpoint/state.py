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
    transfer (what xm.save does), so saving adds no compile and one device->host copy.
    rt: not needed (each tensor's own device says how it is copied); accepted because callers pass it."""
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


# -- reading: a failed read is not a damaged checkpoint ------------------------------------------
class ReadFailed(OSError):
    """A checkpoint could not be read (network, server, a full disk while downloading): nothing says it is
    damaged, so restore does not fall back to an older step (a resumed run would quietly lose progress)."""


READ_TRIES = 3  # on top of the client's own retries: a connection dropped mid-body is not retried by them


def read(store, name: str, tries: int = READ_TRIES) -> bytes:
    """store.get(name), tried again on any error but FileNotFoundError (a deleted object: restore falls
    back past it). After `tries` failures: ReadFailed naming the object and the last error."""
    import time

    for i in range(tries):
        try:
            return store.get(name)
        except FileNotFoundError:
            raise
        except Exception as e:  # OSError, requests' ConnectionError, the client's ServiceUnavailable ...
            last = e
            if i + 1 < tries:
                time.sleep(0.5 * 2**i)
    raise ReadFailed(
        f"reading checkpoint {store.url(name)} failed {tries} times ({type(last).__name__}: {last}); it is not "
        "known to be damaged, so restore stops here instead of falling back to an older step: retry when the "
        "storage is reachable"
    ) from last


# -- never save a state that went non-finite -------------------------------------------------------
def _tensors(o):
    """The tensors of a nested state, CPU shards of a sharded one included (their `.data`)."""
    if torch.is_tensor(o):
        yield "", o
    elif isinstance(o, dict):
        for k, v in o.items():
            for path, t in _tensors(v):
                yield f"{k}.{path}" if path else str(k), t
    elif isinstance(o, (list, tuple)):
        for i, v in enumerate(o):
            for path, t in _tensors(v):
                yield f"{i}.{path}" if path else str(i), t
    elif isinstance(getattr(o, "shards", None), list):  # torch_xla's CPU shards (labkit.checkpoint.shards.stage)
        for s in o.shards:
            if torch.is_tensor(getattr(s, "data", None)):
                yield "", s.data


def refuse_nonfinite(cpu_state, where: str, step: int) -> None:
    """FloatingPointError naming the first tensor with a NaN/inf, before anything is written: the losses
    are read only at log time, so a NaN that came since the last read would otherwise be saved and become
    `latest` (and a resume would start from it). Checked on the host copy the save makes anyway: one pass
    over its floating-point bytes, no extra device transfer (measured here: 0.33 s for 100 MB of float32
    on the loaded 2-core machine, in the caller's thread)."""
    for path, t in _tensors(cpu_state):
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            raise FloatingPointError(
                f"not saving step {step} to {where}: {path or 'a tensor'} holds NaN or inf (the weights went "
                "non-finite since the loss was last read); the last good checkpoint stays `latest`. Lower the "
                "learning rate, add clip_norm, or check the data"
            )


def recorded_entries(state) -> dict:
    """What a commit record keeps of the state for restore(check=...) to read before any tensor: its plain entries
    (numbers, strings, flat dicts of them: the step, epoch, data position, optimizer class and dataset identity of
    labkit.resume), a few hundred bytes. Under torchrun, process 0's."""
    plain = (bool, int, float, str, type(None))
    out = {}
    for k, v in state.items() if isinstance(state, dict) else ():
        if isinstance(v, plain) or isinstance(v, dict) and all(isinstance(x, plain) for x in v.values()):
            out[k] = v
    return out
