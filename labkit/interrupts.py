"""Ctrl-C and SIGTERM during fit(): let the pending checkpoint upload finish, then stop.

    with sigterm_raises():          # SIGTERM (a preempted TPU VM, a stopped container) -> Preempted
        ...train...
    finish_pending_save(manager, rt, step, interrupt=e)
    vote = StepVote(rt)             # torchrun: SIGTERM, a NaN or a callback's stop on one process stops all at one step
    with sigterm_raises(vote): ...; problem = vote.cast(mine); if vote.agreed_on: save; vote.stop_if_agreed(step)

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
from typing import NamedTuple

import torch
import torch.distributed as dist

from labkit.torchrun import side_group


class Preempted(KeyboardInterrupt):
    """SIGTERM arrived during fit() (a preempted TPU VM, a stopped container). A KeyboardInterrupt,
    so `except Exception` in user code does not swallow it."""


class Asked(NamedTuple):
    """What a callback asked the Trainer for (request_stop, request_checkpoint), and a problem seen (a NaN loss):
    under torchrun, what StepVote.share made every process's."""

    stop: bool = False
    after_epoch: bool = False
    save: bool = False
    problem: str | None = None


class StepVote:
    """What one of torchrun's processes learns, made every process's at the same optimizer step: SIGTERM (the signal
    only sets `got`; raising would leave the other processes waiting in the step's collectives for ever) and a
    problem (a NaN/inf loss, a stalled fp16 loss scale: labkit.steplog reads the losses on process 0 only, so the
    others would train on into the next collective and wait there until a timeout). At each step boundary `cast()`
    takes the MAX of both flags over all processes: every process then saves the same step and stops (SIGTERM), or
    raises the same FloatingPointError before any save (a problem, its text sent to all with one all_gather_object,
    only when there is one). share() carries a callback's requests the same way (a stop, a stop after the epoch, a
    save: on_log runs on process 0 only), so every process stops or saves at the same step.

    The cost: one all_reduce of five int32 per optimizer step, on a gloo group over the host's CPUs (a group of its
    own under NCCL), so it never waits for the accelerator: a round trip of a few bytes between the processes, 0.5-1.9
    ms a step measured on a 2-core host loaded with ~10 runnable processes (bench/bench_fsdp.py prints it: 0.1-1 % of
    a 190 ms step; on a quiet host expect loopback TCP's tens of microseconds, not measured here), about a network
    round trip between hosts; it is left out of labkit.parallel.collective_counter's counts, which are the model's traffic. One
    process (or XLA's replicas, whose collectives torch.distributed does not run): inactive, SIGTERM raises Preempted
    at once and a problem raises where it was seen. Its group (under NCCL) waits LABKIT_DIST_TIMEOUT_S
    (labkit.torchrun.side_group)."""

    def __init__(self, rt):
        self.rt = rt
        self.active = bool(rt.uses_ddp and rt.world_size > 1 and dist.is_available() and dist.is_initialized())
        self.got, self.agreed_on, self._group = False, False, None
        self.asked: set = set()  # requests kept for the next share(): "stop", "stop_after_epoch", "save_requested"

    def ask(self, what: str) -> bool:
        """Keep a callback's request (`what`: "stop", "stop_after_epoch" or "save_requested") for the next share(),
        which makes it every process's; False with one process (inactive): the caller acts on it at once."""
        if self.active:
            self.asked.add(what)
        return self.active

    def cast(self, problem: str | None = None) -> str | None:
        """Every process's vote (a collective: every process calls it at the same step). Sets agreed_on (SIGTERM
        anywhere) and returns the problem seen anywhere ("on process r: ..."), else None."""
        return self.share(problem).problem

    def share(self, problem: str | None = None) -> Asked:
        """cast() that also carries what a callback asked for on any process since the last share() (ask()): the
        returned Asked is every process's, with the problem seen anywhere. on_log runs on process 0
        alone, a dashboard's button is pressed on one: acted on by one process, a save would wait in its agreement
        and a stop would leave the others in the next step's collectives. Same cost: the flags ride in the one
        all_reduce (5 int32 instead of 2)."""
        mine, self.asked = self.asked, set()  # one swap: a request made meanwhile (another thread) waits for the next
        asked = Asked("stop" in mine, "stop_after_epoch" in mine, "save_requested" in mine)
        if not self.active:
            return asked._replace(problem=problem)
        if self._group is None:  # the default group where it runs on the CPU, else a gloo one (made once, together)
            self._group = dist.group.WORLD if dist.get_backend() == "gloo" else side_group()
        # outside any dispatch mode: a step's collective count (labkit.parallel.collective_counter) is the model's
        # traffic, which this message of a few bytes is not part of
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            mine = [self.got, problem is not None, asked.stop, asked.after_epoch, asked.save]
            flags = torch.tensor([int(bool(v)) for v in mine], dtype=torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._group)
            got, bad, stop, after_epoch, save = (bool(v) for v in flags.tolist())
            self.agreed_on = got
            if not bad:
                return Asked(stop, after_epoch, save, None)
            seen = [None] * self.rt.world_size
            dist.all_gather_object(seen, problem, group=self._group)
        r, text = next((r, t) for r, t in enumerate(seen) if t is not None)
        return Asked(stop, after_epoch, save, f"{text} on process {r} of {self.rt.world_size}")

    def agreed(self) -> bool:
        """Whether any process got SIGTERM (cast() without a problem)."""
        self.cast()
        return self.agreed_on

    def stop_if_agreed(self, step: int) -> None:
        """After the save at `step`: Preempted on every process, where cast() said so."""
        if not self.agreed_on:
            return
        where = "this process" if self.got else "another process"
        raise Preempted(f"SIGTERM to {where}: every process stopped after step {step} and saved it")


SigtermVote = StepVote  # its older name


@contextlib.contextmanager
def sigterm_raises(vote: StepVote | None = None):
    """During fit, SIGTERM raises Preempted in the main thread (its default action kills the
    process on the spot, losing the pending upload). Elsewhere (a worker thread) nothing changes.
    With an active StepVote (torchrun's processes) it only sets vote.got: the step boundary acts on it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if vote is not None and vote.active:
            vote.got = True
            return
        raise Preempted(f"SIGTERM (signal {signum}) during training")

    try:
        old = signal.signal(signal.SIGTERM, handler)
        # Python's own Ctrl-C handler, re-installed: a native library may have replaced it at the C level
        old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    except (ValueError, OSError):  # not allowed here (embedded interpreters): leave it alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)


@contextlib.contextmanager
def sigterm_deferred():
    """SIGTERM only noted while the block runs (a final evaluation and save whose collectives every process must
    finish); yields a list that holds True afterwards if one came, for the caller to stop then. Outside the main
    thread, nothing changes."""
    got: list = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    try:
        old = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(True))
    except (ValueError, OSError):
        yield got
        return
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, old)


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


class Requests:
    """What a callback may ask of the Trainer (stop, stop after the epoch, save this step), shared by the step vote:
    under torchrun a request made on any process (on_log runs on process 0 only) is every process's at one step.
    The Trainer holds `vote` (a StepVote) and the flags `_stop`, `_stop_after_epoch` and `_save_requested`."""

    def request_stop(self, after_epoch: bool = False) -> None:
        """Stop after the current step (callable from any callback; position kept for a resume).
        after_epoch=True: finish the current epoch (its evaluation, on_epoch_end and epoch-end
        checkpoint included), then stop; a resume starts the next epoch. Under torchrun a request made on any
        process (on_log runs on process 0 only) stops every process at the same step: the step vote shares it."""
        self._ask("stop_after_epoch" if after_epoch else "stop")

    stop = request_stop  # older name

    def request_checkpoint(self) -> None:
        """Save a checkpoint after the current step, whatever checkpoint_every says (needs a
        CheckpointManager; without one the request warns and is dropped). Under torchrun every process saves
        that step, whichever process asked."""
        self._ask("save_requested")

    def _ask(self, what: str) -> None:
        if not self.vote.ask(what):  # one process: at once; torchrun: at the next vote, by every process alike
            setattr(self, f"_{what}", True)

    def _share_requests(self, problem: str | None = None) -> str | None:
        """The requests made on any process since the last vote, and `problem` (a NaN loss), made every process's by
        one StepVote (labkit.interrupts); returns the problem seen anywhere. One process: no collective."""
        asked = self.vote.share(problem)
        self._stop |= asked.stop
        self._stop_after_epoch |= asked.after_epoch
        self._save_requested |= asked.save
        return asked.problem
