"""Ctrl-C and SIGTERM during fit(): let the pending checkpoint upload finish, then stop. The signal plumbing; what
torchrun's processes then agree on is labkit.interrupts.vote.

    with sigterm_raises():          # SIGTERM (a preempted TPU VM, a stopped container) -> Preempted
        ...train...
    finish_pending_save(manager, rt, step, interrupt=e)
    with sigterm_raises(vote): ...  # torchrun (vote: a labkit.interrupts.StepVote): SIGTERM only sets vote.got

A preempted TPU VM or a stopped Colab runtime gets SIGTERM, whose default action ends the process at
once: an upload still in flight would be lost. Turned into an exception (Preempted, a
KeyboardInterrupt), it unwinds like Ctrl-C, and the Trainer waits for the upload before re-raising.
A second interrupt during that wait abandons the upload cleanly (no pointer move, temp file removed).

The window (Google Compute Engine's preemption documentation, read 2026-11; not verified here): a preempted VM
gets an ACPI soft-off, and its guest OS turns that into SIGTERM for its processes; a Spot VM is powered off 30 s
later whatever is running (a standard VM's shutdown gets 120 s). So the wait above only saves what fits: the step in
flight, plus the pending upload, plus the time to close the file, within 30 s on a Spot VM. Bytes that fit are
about (30 s - the step time) x your upload rate to the bucket: measure that rate.

What fits: notebook 01's 10-class ResNet-50 with SGD momentum is 188 MB (23.5 M weights x 8 bytes; the 1,000-class
one of bench/bench_sharded_checkpoint.py is 205 MB), small at any rate a TPU VM reaches. A 1.2 B-weight model's
checkpoint of fp32 weights and AdamW's two moments is about 14 GB (12 bytes a weight; its training state, with the
gradients, is 16 bytes a weight, 19 GB). That does not fit, so save on a schedule and treat SIGTERM as the chance to
finish what was already going up.

The metadata server's key `http://metadata.google.internal/computeMetadata/v1/instance/preempted` (header
`Metadata-Flavor: Google`; add `?wait_for_change=true` to block until it changes) turns TRUE when the preemption
begins, with the soft-off. It tells a shutdown script that this is a preemption; it gives no warning before the 30 s.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import warnings


class Preempted(KeyboardInterrupt):
    """SIGTERM arrived during fit() (a preempted TPU VM, a stopped container). A KeyboardInterrupt,
    so `except Exception` in user code does not swallow it."""


@contextlib.contextmanager
def handlers(pairs: dict):
    """{signal: handler} installed while the block runs, the old ones put back in a `finally`; yields True, or False
    where nothing was installed: outside the main thread (Python allows handlers there only) or where the
    interpreter refuses (an embedded one). The one place labkit installs and restores a signal handler in
    labkit.interrupts (the dashboard's buttons, a layer below, keep their own: labkit.dashboard.controls)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    old: dict = {}
    try:
        for signum, handler in pairs.items():
            old[signum] = signal.signal(signum, handler)
    except (ValueError, OSError):  # not allowed here: leave them all alone
        for signum, prev in old.items():
            signal.signal(signum, prev)
        yield False
        return
    try:
        yield True
    finally:
        for signum, prev in old.items():
            signal.signal(signum, prev)


@contextlib.contextmanager
def sigterm_raises(vote=None):
    """During fit, SIGTERM raises Preempted in the main thread (its default action kills the
    process on the spot, losing the pending upload). Elsewhere (a worker thread) nothing changes.
    With an active StepVote (torchrun's processes: labkit.interrupts.vote) it only sets vote.got: the next step
    boundary, or the epoch's end, acts on it."""

    def handler(signum, frame):
        if vote is not None and vote.active:
            vote.got = True
            return
        raise Preempted(f"SIGTERM (signal {signum}) during training")

    # with Python's own Ctrl-C handler, re-installed: a native library may have replaced it at the C level
    with handlers({signal.SIGTERM: handler, signal.SIGINT: signal.default_int_handler}):
        yield


@contextlib.contextmanager
def sigterm_deferred():
    """SIGTERM only noted while the block runs (a final evaluation and save whose collectives every process must
    finish); yields a list that holds True afterwards if one came, for the caller to stop then. Outside the main
    thread, nothing changes."""
    got: list = []
    with handlers({signal.SIGTERM: lambda signum, frame: got.append(True)}):
        yield got


def finish_pending_save(ck, rt, step: int, interrupt=None, raise_errors: bool = False) -> None:
    """The last upload finishes (or raises) before fit returns. Interrupted: say so, wait for it
    (a second interrupt abandons it cleanly: no pointer move, temp file removed)."""
    if ck is None:
        return
    if interrupt is not None and getattr(ck, "pending", None):
        what = "SIGTERM" if isinstance(interrupt, Preempted) else "interrupt"
        rt.master_print(
            f"[labkit] {what} at step {step}: finishing the pending checkpoint upload (interrupt again to abandon it)"
        )
    try:
        if hasattr(ck, "close"):
            ck.close()
        elif hasattr(ck, "wait"):
            ck.wait()
    except Exception as e:
        if raise_errors:
            raise
        warnings.warn(f"the pending checkpoint save failed too: {type(e).__name__}: {e}", stacklevel=3)
