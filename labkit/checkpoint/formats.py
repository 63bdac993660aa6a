"""What a checkpoint format is, and the one-file format.

CheckpointManager (labkit.checkpoint.manager) owns every decision: when to save, the writer lock, the
refuse-older-step rule, which steps are kept (the newest `keep` and the best, over both formats) and the
restore fallback. A format only knows its own bytes:

    fmt.kind                          "file" or "sharded"
    fmt.name(step)                    what a step is called in the store ("ckpt-00000100.pt", "step-00000100")
    fmt.steps()                       {step: committed?} of every step this format has in the store
    fmt.committed(step)               did a run commit this step (another run's is never replaced)
    fmt.stage(state, rt)              the CPU copy to write, on the caller's thread (no device work later)
    fmt.upload(step, cpu, staged, replace)   store the bytes, invisible to restore; replace() is called first
                                      when the step already exists (the manager refuses or allows it)
    fmt.commit(step, info, record, kept)     the commit point (the manager proved its lock just before)
    fmt.abort(step)                   a failed save's stored bytes go (space the next save needs)
    fmt.read(step, into, map_location)       (state, record), verified; ReadFailed when the store could
                                      not be read (the manager stops), anything else: damaged (it falls back)
    fmt.remove(step)                  delete the step
    fmt.damaged(exc), fmt.unfinished(step), fmt.fallback_message(step, exc)   what restore says and does

OneFile: `ckpt-00001200.pt`, a torch.save of a CPU-only state (loadable with weights_only=True), uploaded
create-only with its crc32c; its commit point is the `latest` pointer (labkit.checkpoint.pointer), which
also records the crc32c of every kept object so a restore verifies the whole object. The sharded format
(DCP folders with a COMMITTED marker) is labkit.checkpoint.dcp.
"""

from __future__ import annotations

import os
import time

import torch

from labkit.checkpoint import safe_load
from labkit.checkpoint.pointer import NAME, Pointer, object_name, step_of
from labkit.checkpoint.pointer import POINTER as NAME_LATEST
from labkit.checkpoint.state import READ_TRIES, ReadFailed, to_cpu, verify
from labkit.checkpoint.state import read as read_checked
from labkit.checkpoint.writer import no_space
from labkit.cloud import gcs


class OneFile:
    kind = "file"
    restores_in_place = False  # restore(into=...) returns the loaded CPU state; the caller loads it

    def __init__(self, store):
        self.store = store
        self.pointer = Pointer(store)  # `latest`: the commit point, the best, the kept objects' crc32c
        ptr = self.pointer.read()
        self.objects = dict(ptr.get("objects") or {}) if ptr else {}  # name -> crc32c of kept objects
        if ptr and ptr.get("crc32c"):
            self.objects.setdefault(ptr["name"], ptr["crc32c"])

    def name(self, step: int) -> str:
        return object_name(step)

    def steps(self) -> dict[int, bool]:
        """Every object counts as committed (the pointer may be lost; each object verifies on its own), except
        one newer than the pointer: uploaded by a writer that died before moving it."""
        ptr = self._pointer()
        top = ptr["step"] if ptr else None
        return {step_of(n): top is None or step_of(n) <= top for n in self.store.list("ckpt-") if NAME.match(n)}

    def committed(self, step: int) -> bool:
        ptr = self._pointer() or {}
        name = object_name(step)
        return name == ptr.get("name") or name in (ptr.get("objects") or {})

    def record(self) -> dict | None:
        return self.pointer.read()

    def stage(self, state, rt):
        from labkit.checkpoint.shards import is_sharded

        if is_sharded(state) and rt is not None and rt.world_size > 1 and rt.uses_ddp:
            raise ValueError(
                f"checkpoint to {self.store.url('')}: format='file' holds whole tensors, and this state is split over "
                f"{rt.world_size} processes (DTensors: parallel='fsdp2'); use format='auto' or 'sharded' (DCP)"
            )
        return to_cpu(state, rt)  # every replica calls it: keeps XLA graphs identical across replicas

    def upload(self, step, cpu_state, staged, replace) -> dict:
        name = object_name(step)
        tmp = self.store.temp_file(name)  # its name carries our pid: only a dead writer's is swept
        try:
            try:
                with open(tmp, "wb") as f:
                    torch.save(cpu_state, f)
            except Exception as e:
                if no_space(e, self.store) is None:
                    raise
                os.remove(tmp)  # the partial file first: the message then says what is really free
                raise no_space(e, self.store) from e
            crc, size = gcs.crc32c_b64(tmp), os.path.getsize(tmp)  # the one crc pass of this save
            staged(step, tmp)
            try:  # create-only: one request, and no other writer's object is ever overwritten
                self.store.put_if_absent(name, tmp, crc)
            except FileExistsError:
                replace()  # ours to replace (the manager checks), then the lock is proved again
                self.store.put(name, tmp, crc)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return {"crc32c": crc, "size": size}

    def commit(self, step, info, record, kept) -> None:
        name = object_name(step)
        objects = {n: c for n, c in self.objects.items() if n in kept}
        objects[name] = info["crc32c"]
        self.pointer.write({"name": name, "step": int(step), **info, **record, "objects": objects, "time": time.time()})
        self.objects = objects

    def abort(self, step) -> None:
        pass  # an uploaded object no pointer names is invisible; the next save prunes it

    def read(self, step, into=None, map_location="cpu"):
        name = object_name(step)
        ptr = self._pointer()
        expect = dict(self.objects)
        if ptr is not None:
            expect.update(ptr.get("objects") or {})
            if ptr.get("crc32c"):
                expect[ptr["name"]] = ptr["crc32c"]
        data = read_checked(self.store, name)  # a failed read raises ReadFailed: no fallback
        url = self.store.url(name)
        verify(data, url, expect.get(name))
        state = safe_load.torch_load(data, url, map_location)  # weights_only: runs no code
        record = ptr if ptr is not None and ptr["name"] == name else {"name": name, "step": int(step)}
        return state, record

    def _pointer(self):
        """The pointer (a look only), read as a checkpoint is: a store error is tried again, then ReadFailed (a
        pointer that does not parse is None, with a warning: parse_pointer). Never a quiet fall back a step."""
        for i in range(READ_TRIES):
            try:
                return self.pointer.read(track=False)
            except Exception as e:  # OSError, requests' ConnectionError, the client's ServiceUnavailable ...
                last = e
                if i + 1 < READ_TRIES:
                    time.sleep(0.5 * 2**i)
        raise ReadFailed(
            f"reading {self.store.url(NAME_LATEST)} failed {READ_TRIES} times ({type(last).__name__}: {last}); "
            "restore stops here instead of falling back to an older step: retry when the storage is reachable"
        ) from last

    def unfinished(self, step) -> str | None:
        return None  # an object newer than the pointer is skipped quietly; asked for by step, it is read

    def damaged(self, exc) -> bool:
        return True  # the whole object was read: whatever failed is in its bytes

    def fallback_message(self, step, exc) -> str:
        return (
            f"checkpoint {self.store.url(object_name(step))} is unreadable ({type(exc).__name__}: {exc}); "
            "falling back to the previous one"
        )

    def remove(self, step) -> None:
        self.store.delete(object_name(step))
