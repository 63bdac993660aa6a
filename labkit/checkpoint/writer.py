"""One save at a time in a background thread: what both checkpoint formats compose.

    w = BackgroundWriter("checkpoint", "gs://b/run")
    w.submit(step, write_fn, *args)   # waits for the previous save, then runs write_fn(*args) in a thread
    w.staged(step, path)              # inside write_fn, before the commit point: the test hook, the abandon point
    w.wait()                          # block until done; re-raises the save's error (also on the next submit)

Errors of a background save surface on the next submit(), wait() or close(): training goes on while the
upload runs, and a failed one is never silent. close() finishes the pending save; a second Ctrl-C while
waiting abandons it (its next staged() call stops it, nothing becomes visible) and is re-raised.

Tests hook in from outside: `w.on_stage = fn` (None by default) is called as fn(step, path) by staged(),
with the step's bytes written but not yet visible (a temp file, or a folder whose commit marker is not
written). The kill -9 tests install a hook that holds the save open or kills the process right there.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings


class Abandoned(Exception):
    """The pending save was abandoned (a second interrupt): nothing becomes visible."""


class BackgroundWriter:
    def __init__(self, what: str, where: str, async_save: bool = True):
        self.what, self.where, self.async_save = what, where, async_save  # what/where: named in errors
        self.on_stage = None  # tests: fn(step, path) called by staged()
        self._thread: threading.Thread | None = None
        # set by the thread when it ends. Waiting on it (not on Thread.join) keeps an interrupt safe: on
        # Python 3.11 a join interrupted by a signal handler's exception marks the still-running thread
        # as stopped (bpo-45274's fix), so a second join would return at once and lose the upload
        self.finished = threading.Event()
        self.finished.set()
        self._error: BaseException | None = None
        self._abandon = threading.Event()
        self._step: int | None = None

    @property
    def pending(self) -> int | None:
        """The step whose save is still running, or None."""
        return self._step if self._thread is not None and not self.finished.is_set() else None

    def submit(self, step: int, fn, *args) -> None:
        """Run fn(*args) as the save of `step`: in a thread (async_save) after the previous one ended."""
        self.wait()  # at most one pending save; re-raises the previous one's error
        self._abandon.clear()
        self._step = int(step)
        if not self.async_save:
            try:
                fn(*args)
            except Abandoned:
                pass
            return
        self.finished = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(self.finished, fn, args), name=f"labkit-ckpt-{step}", daemon=True
        )
        self._thread.start()

    def _run(self, finished: threading.Event, fn, args):
        try:
            # serialising and uploading should take idle cycles, not the host threads that feed and run
            # the training step (Linux: per-thread nice)
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (AttributeError, OSError):
                pass
            fn(*args)
        except Abandoned:
            pass
        except BaseException as e:  # surfaced on the next submit()/wait()/close()
            self._error = e
        finally:
            finished.set()

    def staged(self, step: int, path: str) -> None:
        """Called by a save once its bytes are written and before they become visible."""
        if self.on_stage is not None:
            self.on_stage(step, path)
        self.check_abandon(step)

    def check_abandon(self, step: int) -> None:
        if self._abandon.is_set():
            raise Abandoned(step)

    def raise_error(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise RuntimeError(f"an earlier {self.what} save to {self.where} failed: {err}") from err

    def wait(self) -> None:
        """Block until the pending save finished; re-raise its error."""
        t = self._thread
        if t is not None:
            self.finished.wait()  # an interrupt here leaves the save pending: close() can still finish it
            t.join()  # ended: returns at once
            self._thread = None
        self.raise_error()

    def close(self) -> None:
        """Finish the pending save. An interrupt while waiting abandons it cleanly (the commit point is
        not reached; temp files are removed by the save's own cleanup) and is re-raised."""
        step = self.pending
        try:
            self.wait()
        except KeyboardInterrupt:
            self._abandon.set()
            t = self._thread
            if t is not None and self.finished.wait(timeout=30):  # it stops at its next check
                t.join()
                self._thread = None
            warnings.warn(f"{self.what} of step {step} to {self.where} abandoned (interrupted)", stacklevel=3)
            raise


def no_space(err: BaseException, store) -> OSError | None:
    """An OSError(ENOSPC) naming where the staging went and how much is free, when `err` comes from a
    full disk; else None. torch.save reports one as "[enforce fail at inline_container.cc] unexpected
    pos" with the OSError only in its context; DCP as a CheckpointException holding it per rank."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            where, free_mb = store.space_left()
            return OSError(errno.ENOSPC, f"no space left on {where} ({free_mb} MB free) while writing a checkpoint")
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None
