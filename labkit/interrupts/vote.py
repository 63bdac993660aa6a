"""What torchrun's processes agree on, so that no process decides, stops or drifts alone: the step vote (SIGTERM,
a NaN, a callback's stop or save, made every process's at one optimizer step) and the run's settings, compared once.

    vote = StepVote(rt)             # torchrun: SIGTERM, a NaN or a callback's stop on one process stops all at one step
    with sigterm_raises(vote): ...; problem = vote.cast(mine); if vote.agreed_on: save; vote.stop_if_agreed(step)
    same_everywhere(rt, {"lr": 0.1, "steps_per_epoch()": 30})   # at Trainer construction: raises on every process

One process (or XLA's replicas, whose collectives torch.distributed does not run): nothing is sent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist

from labkit.interrupts.signals import Preempted
from labkit.torchrun import active, side_group


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
    takes the MAX of every flag over all processes: every process then saves the same step and stops (SIGTERM), or
    raises the same FloatingPointError before any save (a problem, its text sent to all with one all_gather_object,
    only when there is one). share() carries a callback's requests the same way (a stop, a stop after the epoch, a
    save: on_log runs on process 0 only), so every process stops or saves at the same step. One more vote at each
    epoch's end, after its evaluation (Requests._epoch_end): a save asked from on_eval or SIGTERM during the
    evaluation saves that position and, for SIGTERM, stops there.

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
        self.active = active(rt)
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


class Requests:
    """What a callback may ask of the Trainer (stop, stop after the epoch, save this step), shared by the step vote:
    under torchrun a request made on any process (on_log runs on process 0 only) is every process's at one step, or
    at the epoch's end (_epoch_end).
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

    def _epoch_end(self) -> None:
        """The epoch's end, after its evaluation and on_epoch_end: the position moves to the next epoch's first batch,
        then what was asked since the last step acts here, every process alike (one vote): a save asked from on_eval,
        or SIGTERM during the evaluation, saves this position and, for SIGTERM, stops (Preempted). Left to the next
        step, it cost a loader restart and one more step out of torchrun's and a Spot VM's 30 s. cfg.checkpoint_every
        = 0 saves here anyway ("at each epoch end")."""
        self._share_requests()
        self.epoch, self.batch_in_epoch = self.epoch + 1, 0  # a save now resumes at the next epoch
        asked, self._save_requested = self._save_requested or self.vote.agreed_on, False
        if self.checkpoint is not None and (asked or not self.cfg.checkpoint_every):
            self.checkpoint.save(self.step, self.state_dict(), metrics=self._last_metrics(), force=asked)
        elif asked and not self.vote.agreed_on:
            warnings.warn("request_checkpoint() ignored: this Trainer has no CheckpointManager", stacklevel=3)
        self.vote.stop_if_agreed(self.step)

    def _share_requests(self, problem: str | None = None) -> str | None:
        """The requests made on any process since the last vote, and `problem` (a NaN loss), made every process's by
        one StepVote (labkit.interrupts); returns the problem seen anywhere. One process: no collective."""
        asked = self.vote.share(problem)
        self._stop |= asked.stop
        self._stop_after_epoch |= asked.after_epoch
        self._save_requested |= asked.save
        return asked.problem


class SettingsDiffer(ValueError):
    """The processes of one torchrun job resolved a setting differently: raised on every process, naming each
    setting that differs and which process holds which value."""


def same_everywhere(rt, settings: dict, what: str = "this run's settings") -> None:
    """Raise SettingsDiffer on every process when any process resolved `settings` ({name: a plain value}) otherwise.
    Each process decides for itself what its environment says (LABKIT_* variables, precision "auto", the memory
    format's probe, the compile decision, its dataset's length): a different learning rate on one host lets DDP's
    replicas drift apart silently, and a different number of steps per epoch leaves one process evaluating while
    the others train, until the timeout. The cost: one all_gather_object of a 16-character digest on the default
    group; the whole settings only when the digests differ. A collective: every process calls it at the same point."""
    if not active(rt):
        return
    digest = hashlib.sha256(repr(sorted((k, repr(v)) for k, v in settings.items())).encode()).hexdigest()[:16]
    every = [None] * rt.world_size
    dist.all_gather_object(every, digest)
    if len(set(every)) == 1:
        return
    full = [None] * rt.world_size
    dist.all_gather_object(full, {k: repr(v) for k, v in settings.items()})
    lines = []
    for key in sorted(set().union(*full)):
        held: dict = {}
        for r, s in enumerate(full):
            held.setdefault(s.get(key, "(not set)"), []).append(str(r))
        if len(held) > 1:
            lines.append(f"{key}: " + "; ".join(f"{v} on process {', '.join(rs)}" for v, rs in held.items()))
    raise SettingsDiffer(
        f"the {rt.world_size} processes resolved {what} differently (each process reads its own environment and "
        "data; every one must train alike): " + " | ".join(lines) + ". Give every process the same settings "
        "(LABKIT_* variables, flags) and the same data"
    )


def trainer_settings(trainer) -> dict:
    """What this process decided for the run, each from its own environment and data: TrainConfig's fields
    (after the LABKIT_* overlay), the precision, the memory format, the step capture (the compile decision), the
    plan, each optimizer group's hyperparameters and steps_per_epoch(). Under torchrun every process must hold
    the same: the Trainer compares them once, at construction (same_everywhere)."""
    out = {f"TrainConfig.{k}": v for k, v in dataclasses.asdict(trainer.cfg).items()}
    out.update(precision=trainer.precision.name, memory_format=str(trainer.layout.memory_format))
    out.update(step_capture=repr(trainer.capture), plan=trainer.plan.describe())
    for i, group in enumerate(trainer.optimizer.param_groups if trainer.optimizer is not None else ()):
        for k, v in group.items():
            if torch.is_tensor(v) and v.numel() == 1:  # a captured step's lr: a 0-dim CPU tensor
                v = v.item()
            if k != "params" and (v is None or isinstance(v, (bool, int, float, str, tuple))):
                out[f"optimizer group {i} {k}"] = v
    try:
        out["steps_per_epoch()"] = trainer.steps_per_epoch() if trainer.train_loader is not None else None
    except TypeError:  # a stream: no length
        out["steps_per_epoch()"] = None
    return out
