"""Resuming with another batch size, chip count or optimizer: continue at the same sample, or say why not.

    state = trainer.checkpoint.restore(into=trainer.state_dict())
    trainer.load_state_dict(state)      # load_trainer_state(): check(), then batches_done(), below

A checkpoint records where the epoch stopped in SAMPLES (batches done x global batch, the global batch
being the loader's batch x world size x accum_steps), not in batches: a run resumed with batch 32 after batch 16, or
on 4 chips after 1 (SPMD makes the per-step batch 4x larger), skips exactly the samples already
trained. Counted in batches, 6 batches of 16 would skip 6 batches of 32, and 96 samples of the epoch
would never be trained; counted in steps, the 1-chip run's step 12 would be past the 4-chip run's last
step, and nothing would train, without a word.

What cannot continue exactly is refused by name: a position that is not a whole number of the new
batches, an optimizer of another class (Adam's state loaded into SGD fails later, inside SGD.step, with
KeyError: 'momentum'), a mid-epoch position in another dataset (the checkpoint records its sample count
and, for a manifest, its generation: 96 samples into 320 say nothing about 80, and a smaller dataset
trained 0 rows in the resumed epoch), a mid-epoch position under a random sampler that keeps no state
(DataLoader(shuffle=True): the resumed epoch is a new permutation, so skipping its first k batches
trains some samples twice and others never). A learning rate that differs from the checkpoint's warns:
the checkpoint's wins (optimizer and scheduler states hold it), as does another dataset at an epoch end.
"""

from __future__ import annotations

import inspect
import warnings

from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from labkit.checkpoint.state import check_compatible
from labkit.runtime.layout import match_state
from labkit.seeding import manual_seed, rng_state, set_rng_state
from labkit.versions import versions

# samplers that draw a new order each epoch from a generator whose state no checkpoint holds
_UNREPLAYABLE = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


def optimizer_class(optimizer) -> str:
    t = type(optimizer)
    return f"{t.__module__}.{t.__qualname__}"


def data_position(trainer) -> dict:
    """What a checkpoint records beside step/epoch/batch_in_epoch (0 where unknown)."""
    gb = trainer.global_batch() or 0
    return {
        "samples_in_epoch": trainer.batch_in_epoch * gb,
        "global_batch": gb,
        "world_size": trainer.rt.world_size,
        "optimizer_class": optimizer_class(trainer.optimizer),
        "dataset": dataset_identity(trainer.train_loader),
    }


def _host(loader):
    return getattr(loader, "loader", loader)  # labkit's DeviceLoader wraps the user's loader


def dataset_identity(loader) -> dict:
    """What says which data a position counts in: the dataset's sample count (a shard stream's num_samples over
    every shard, else len) and, for a stream read from a manifest (data_tools.stream.ShardStream), the manifest's
    generation. {} when unknown."""
    ds = getattr(_host(loader), "dataset", None)
    out = {}
    total = getattr(ds, "num_samples", None)  # a shard stream: the samples of every shard, whatever the processes
    if isinstance(total, int) and not isinstance(total, bool):
        out["total_samples"] = total  # its len() is this process's share, which another number of processes changes
    else:
        try:
            out["samples"] = int(len(ds))
        except Exception:  # no len (an IterableDataset without one), or no dataset
            pass
    gen = getattr(ds, "generation", None)
    if isinstance(gen, (int, str)):
        out["generation"] = gen
    return out


def _random_sampler(loader):
    host = _host(loader)
    for s in (getattr(host, "sampler", None), getattr(getattr(host, "batch_sampler", None), "sampler", None)):
        if isinstance(s, _UNREPLAYABLE):
            return s
    return None


def check_data(state: dict, loader) -> None:
    """Refuse a mid-epoch resume that cannot skip exactly the samples already trained: another dataset
    (its identity changed), or a random sampler whose order is not replayed. At an epoch end another
    dataset only warns: nothing is skipped."""
    if loader is None:
        return
    saved, now = state.get("dataset") or {}, dataset_identity(loader)
    keys = [k for k in ("samples", "total_samples", "generation") if k in saved and k in now and saved[k] != now[k]]
    changed = [f"{k} {saved[k]!r} -> {now[k]!r}" for k in keys]
    mid = int(state.get("batch_in_epoch") or 0) > 0
    where = f"{state.get('samples_in_epoch', '?')} samples into epoch {state.get('epoch', '?')}"
    if changed and mid:
        raise ValueError(
            f"the checkpoint stopped {where} of another dataset ({', '.join(changed)}): that position does not "
            "name the same samples here. Resume with the same data, from a checkpoint saved at an epoch end "
            "(checkpoint_every=0), or start a new run (resume=False)"
        )
    if changed:
        warnings.warn(f"resume: the dataset changed since the checkpoint ({', '.join(changed)})", stacklevel=3)
    sampler = _random_sampler(loader)
    if mid and sampler is not None:
        raise ValueError(
            f"the checkpoint stopped {where}, and this loader's {type(sampler).__name__} draws a new order for "
            "the resumed epoch (its generator's state is not in the checkpoint): skipping the first batches of "
            "that order would train some samples twice and others never. Use a sampler whose order depends on "
            "(seed, epoch) with set_epoch (labkit's loaders, DistributedSampler), save at epoch ends "
            "(checkpoint_every=0), or start a new run (resume=False)"
        )


def check_optimizer(state: dict, optimizer) -> None:
    """Refuse another optimizer class; warn when the learning rate given now loses to the checkpoint's."""
    saved, mine = state.get("optimizer_class"), optimizer_class(optimizer)
    if saved and saved != mine:
        raise ValueError(
            f"the checkpoint was trained with {saved}, this run's optimizer is {mine}: their states do not "
            "carry over; build the same optimizer class to resume, or start a new run (resume=False)"
        )
    groups = state.get("optimizer", {}).get("param_groups", [])
    for i, (old, new) in enumerate(zip(groups, optimizer.param_groups)):
        key = "initial_lr" if "initial_lr" in old and "initial_lr" in new else "lr"  # a scheduler's base
        if key in old and key in new and old[key] != new[key]:
            warnings.warn(
                f"resume: param group {i} was given lr={new[key]!r} but the checkpoint's lr={old[key]!r} is "
                "restored with the optimizer (and scheduler) state; set the new one after resuming to change it",
                stacklevel=3,
            )


def check(state: dict, optimizer, loader) -> None:
    """Everything that refuses a resume, before any state is loaded into the model (a refused resume leaves the
    model as it was, so a new run starts from its own weights): check_optimizer, then check_data."""
    check_optimizer(state, optimizer)
    check_data(state, loader)


def batches_done(state: dict, global_batch: int | None) -> int:
    """The checkpoint's position in this run's batches: samples done // this run's global batch."""
    batches = int(state["batch_in_epoch"])
    old = int(state.get("global_batch") or 0)
    if not old or not global_batch or old == global_batch or not batches:
        return batches
    samples = int(state.get("samples_in_epoch") or batches * old)
    world = f"world size {state.get('world_size', '?')}"
    if samples % global_batch:
        raise ValueError(
            f"the checkpoint stopped {samples} samples into epoch {state['epoch']} ({batches} batches of "
            f"{old}, {world}); this run's global batch is {global_batch} (batch x world size x accum_steps), which does "
            f"not divide {samples}: resume with a global batch that divides {samples}, or from a checkpoint "
            "saved at an epoch end (checkpoint_every=0)"
        )
    return samples // global_batch


def trainer_state(self) -> dict:  # self: the Trainer
    """What a checkpoint of this Trainer holds (Trainer.state_dict)."""
    if getattr(self, "_master_only", False) and self.rt.world_size > 1 and self.rt.uses_ddp:
        raise RuntimeError(
            "Trainer.state_dict() called in on_log, which runs on process 0 only: under torchrun it is a collective "
            "(every process calls it at the same point), so process 0 would wait for the others for ever. Ask for a "
            "save with trainer.request_checkpoint() instead (every process saves that step)"
        )
    self.plan.sync_buffers(self.module)  # torchrun: process 0's BatchNorm statistics, whichever copy DCP keeps
    state = {
        "model": self.plan.model_state(self.module),  # the plain names; DTensors under fsdp2 (labkit.parallel)
        "optimizer": self.plan.optimizer_state(self.module, self.optimizer),
        "step": self.step,
        "epoch": self.epoch,
        "batch_in_epoch": self.batch_in_epoch,
        "config": self.cfg.to_dict(),
        "rng": rng_state(self.rt),
        **self.plan.per_process("rng", rng_state(self.rt)),  # torchrun: every process's generators, each its own
        "versions": versions(),
        **data_position(self),  # the data position in samples, the global batch, world size, optimizer class
    }
    if self.scheduler is not None:
        state["scheduler"] = self.scheduler.state_dict()
    if self.precision.state_dict():  # fp16: the GradScaler's loss scale
        state["scaler"] = self.precision.state_dict()
    return state


def restore(self) -> None:  # self: the Trainer
    """Load the newest committed checkpoint of self.checkpoint, if any. The template DCP fills in place is the
    Trainer's own state without `rng_by_process` and `dataset`: those are read as the checkpoint saved them, whatever
    its number of processes or the labkit that wrote it (DCP fails on a key the template has and the file lacks)."""
    template = self.state_dict()
    for key in ("rng_by_process", "dataset"):  # read as saved: per process, or what another labkit recorded
        template.pop(key, None)
    # refused before anything is read into the model, from the step's commit record (every process: one outcome)
    check = {"check": lambda saved: _check_quietly(self, saved)}
    if "check" not in inspect.signature(self.checkpoint.restore).parameters:  # a checkpoint object of your own
        check = {}
    state = self.checkpoint.restore(into=template, **check)  # None: nothing saved yet
    if state is not None:
        self.load_state_dict(state)


def _check_quietly(self, saved: dict) -> None:  # self: the Trainer
    """check() on a step's recorded position (or its loaded state), raising only: its warnings are said once, by
    load_trainer_state, when the state is loaded."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(saved, self.optimizer, self.train_loader)


def load_trainer_state(self, state: dict) -> None:  # self: the Trainer
    """Restore a Trainer from trainer_state(): refused before anything is loaded when the model, optimizer or
    data differ (names the first mismatch); the data position is counted in samples and turned into this run's batches."""
    check_compatible(state["model"], self.module)  # names the first mismatched key
    check(state, self.optimizer, self.train_loader)  # other optimizer class or data: refused, nothing loaded
    # XLA: a buffer of its own for each step counter, or the first step after the resume compiles again
    state = dict(state, model=self.rt.own_scalars(state["model"]), optimizer=self.rt.own_scalars(state["optimizer"]))
    self.plan.load_model_state(self.module, state["model"])
    self.plan.load_optimizer_state(self.module, self.optimizer, state["optimizer"])
    self.capture.prepare(self.optimizer)  # the checkpoint's param groups replaced the prepared ones
    if self.layout.channels_last:  # the moments arrive contiguous: laid out as their weights are (fused AdamW)
        match_state(self.optimizer)
    if self.scheduler is not None and "scheduler" in state:
        self.scheduler.load_state_dict(state["scheduler"])
    if "scaler" in state:
        self.precision.load_state_dict(state["scaler"])
    self.step, self.epoch = int(state["step"]), int(state["epoch"])
    self.batch_in_epoch = batches_done(state, self.global_batch())  # samples -> this run's batches
    if self.train_loader is not None:  # the step counter goes on; the epochs count samples
        self._step_offset = self.step - self.epoch * self.steps_per_epoch() - self.batch_in_epoch
    if "rng" in state:  # dropout/augmentation draws continue exactly where they stopped
        _load_rng(self, state)
    self.rt.master_print(f"[labkit] resumed at step {self.step} (epoch {self.epoch}, batch {self.batch_in_epoch})")


def _load_rng(self, state: dict) -> None:  # self: the Trainer
    """Each process's generators as they were at the save: its own (`rng_by_process`, saved by every process under
    torchrun), else the one `rng` (one process; or an older checkpoint, whose `rng` was one process's). Resumed on
    another number of processes, a process the checkpoint had no generators for is seeded from (step, process)
    instead, and the run says so: its dropout and augmentation draws differ from an uninterrupted run's."""
    rank, world = self.rt.ordinal, self.rt.world_size
    mine = (state.get("rng_by_process") or {}).get(f"process{rank}")
    set_rng_state(mine if mine is not None else state["rng"], self.rt)
    saved = int(state.get("world_size") or 1)
    if saved == world and (mine is not None or world == 1):
        return
    if mine is None and rank > 0:
        manual_seed(int(state["step"]) * 1_000_003 + rank, self.rt)
    if saved == world:
        said = "the checkpoint kept one process's generators; processes 1.. reseeded from (step, process)"
    elif world > saved:
        said = f"processes {saved}..{world - 1} reseeded from (step, process), 0..{saved - 1} continue their own"
    else:
        said = f"processes 0..{world - 1} continue the generators of the same number, {world}..{saved - 1}'s are unused"
    self.rt.master_print(f"[labkit] resumed on {world} processes from a checkpoint of {saved}: {said}")
