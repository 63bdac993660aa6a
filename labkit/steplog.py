"""The Trainer's records: losses summed on the device each step, read once per log interval in a closure.

    log = StepLog(rt, cfg, precision)
    for batch in log.timed(loader, loader):              # the feed meter: time spent waiting for each batch
        log.add(loss, rows=batch_rows * rt.world_size)   # every step: device tensors only, no host sync
    if log.due(step, total):
        log.close(step, epoch, optimizer, on_record)      # on_record(dict of Python numbers) after the step ran
    log.raise_problem(step)                                # a NaN loss, a run of skipped fp16 steps: raises

Reading a device value forces the graph to run and the host to wait (on XLA, an execution and a
device->host transfer). So nothing is read per step: `close` hands the interval's per-step tensors to
rt.add_step_closure, which runs after rt.sync() executed the step, and reads them all in ONE transfer.
The checks that need the values ride on that same transfer:
- a NaN/inf loss: which step (a second transfer, only then);
- fp16 with a GradScaler: a step it skipped (inf/NaN gradients) halves its loss scale, so the per-step
  scale, recorded as a device tensor, tells how many steps were skipped (`skipped_steps` in the record);
  cfg.max_skipped_steps in a row means the weights stopped changing: a problem like a NaN loss.

The feed meter needs no device value at all: `timed` reads the host clock around each `next(batch)`,
and `close` the clock at each interval's end. A record then says how long a step waited for its batch
(`data_wait_s`), how long a whole step took (`step_s`, host wall time from one log to the next, so
compiles, callbacks and an evaluation in the interval count too) and the share (`data_wait_frac`).
A step that waits for its batch is a chip left idle: input-bound (labkit.dashboard.rules.INPUT_BOUND).
On XLA the host runs ahead of the device, so a chip that is the bottleneck shows as time outside
the wait (in the step's sync or upload), never inside it.
"""

from __future__ import annotations

import math
import time
import warnings

from labkit.accumulate import DeviceAccumulator, read, to_host


class StepLog:
    """clock: the host clock every time here is read from (tests give a fake one to control the feed meter)."""

    def __init__(self, rt, cfg, precision=None, clock=time.perf_counter):
        self.rt, self.cfg, self.precision, self.clock = rt, cfg, precision, clock
        self._acc = DeviceAccumulator(rt)
        self.last_rows = None  # the last step's rows over all replicas
        self.begin_fit()
        self.begin_epoch()

    def begin_fit(self) -> None:
        self.t0 = self._last_emit_t = self._last_log_t = self.clock()
        self._interval_examples = self._interval_steps = 0
        self._wait_s, self._interval_t0 = 0.0, self.t0  # the feed meter's interval: data wait, start
        self._problem, self._skips_in_a_row = None, 0
        # the scale before the first step: one read per fit() (a sync on CUDA), never per step
        self._last_scale = self.precision.scale() if self.precision is not None else None

    def begin_epoch(self) -> None:
        """The rate since epoch start is timed from the last reading before the epoch (the same clock as the
        interval rate, so it is their running mean), counting the steps trained since that reading too. Timed
        from this call instead, it missed the host work done after the last reading (callbacks, drawing) and
        began each epoch above every interval rate (measured: 1010/s against ~600/s). An interval that spans
        the boundary keeps its examples (they were dropped: its rate came out halved)."""
        self._epoch_t0, self._epoch_before = self._last_emit_t, self._interval_examples
        self.epoch_examples = 0

    def timed(self, batches, loader=None):
        """Yields the batches, adding the time the loop waited for each one to the interval's data wait (two
        clock reads per step, no device sync). Only a starving wait counts: one that began with at most one batch
        made ahead in `loader` (a labkit.DeviceLoader's fetched - yielded). A wait that began with more was the
        copy of a finished batch to the device queued behind the step running there (XLA:CPU: with data in memory,
        every 4th batch waited a whole step this way, 40 % of the time), not the input pipeline's."""
        ahead = (lambda: loader.fetched - loader.yielded) if hasattr(loader, "fetched") else (lambda: 0)
        source = getattr(loader, "loader", loader)
        self.feed_workers = getattr(source, "num_workers", None)  # the feed's processes
        self.feed_in_memory = isinstance(source, (list, tuple))  # batches made before the run: no decoding to speed up
        it = iter(batches)
        while True:
            starving, t = ahead() <= 1, self.clock()
            try:
                batch = next(it)
            except StopIteration:
                return
            if starving:
                self._wait_s += self.clock() - t
            yield batch

    def add(self, loss, rows: int) -> None:
        """One step's loss (a tensor, or {"loss": t, "acc": t, ...}: extras are averaged too)."""
        extra = {}
        if isinstance(loss, dict):
            extra, loss = {k: v for k, v in loss.items() if k != "loss"}, loss["loss"]
        scale = self.precision.scale_tensor() if self.precision is not None else None
        if scale is not None:  # fp16: the loss scale after this step, a device tensor (no host sync)
            extra["_scale"] = scale
        self._acc.add(loss=loss.detach(), **extra)
        self.last_rows = rows
        self._interval_steps += 1
        self.epoch_examples += rows
        self._interval_examples += rows

    @property
    def open_steps(self) -> int:
        """Steps added since the last close(): a Trainer closes them when fit() ends, so no step goes unrecorded."""
        return self._interval_steps

    def due(self, step: int, total: int) -> bool:
        c = self.cfg
        if (c.log_every and step % c.log_every == 0) or step >= total:
            return True
        return bool(c.log_seconds) and self.clock() - self._last_log_t >= c.log_seconds

    def close(self, step: int, epoch: int, optimizer, on_record) -> None:
        """End the interval: its sums are read in a closure after this step's sync (master only)."""
        sums, self._last_log_t = self._acc.take(), self.clock()
        meta = {"step": step, "epoch": epoch, "examples": self._interval_examples}
        # the epoch's count and clock, taken now: on XLA the closure runs at the next sync. The loop syncs right
        # after close(), but a loop that began the next epoch first would mix the two epochs
        meta["epoch_examples"] = self.epoch_examples + self._epoch_before
        meta["epoch_t0"], self._interval_examples = self._epoch_t0, 0
        # the feed meter, on the host clock: this interval's wait for data and its wall time
        meta["feed"] = (self._wait_s, self._last_log_t - self._interval_t0, max(self._interval_steps, 1))
        self._wait_s, self._interval_t0, self._interval_steps = 0.0, self._last_log_t, 0
        if self.rt.is_master:  # only the master reads and draws
            self.rt.add_step_closure(self._emit, args=(sums, meta, optimizer, on_record))

    def take_problem(self) -> str | None:
        """The problem the closure found since the last call (a NaN loss, a stalled loss scale), else None."""
        problem, self._problem = self._problem, None
        return problem

    def raise_problem(self, step: int, problem: str | None = None) -> None:
        """After the step's sync: a problem (this process's, or `problem` as the processes' vote returned it)
        raises FloatingPointError naming the step (cfg.continue_on_nonfinite=True: a RuntimeWarning, and training
        goes on)."""
        problem = problem if problem is not None else self.take_problem()
        if problem is None:
            return
        msg = f"{problem} (seen at the log of step {step}): lower the learning rate, add clip_norm, or check the data"
        if self.cfg.continue_on_nonfinite:
            warnings.warn(msg + "; training on (continue_on_nonfinite=True)", RuntimeWarning, stacklevel=4)
            return
        raise FloatingPointError(msg + " (TrainConfig.continue_on_nonfinite=True trains on)")

    def _emit(self, sums: dict, meta: dict, optimizer, on_record) -> None:
        losses, scales = sums.pop("loss", []), sums.pop("_scale", [])
        vals = read({"loss": losses, **sums, **{("_scale", i): t for i, t in enumerate(scales)}})  # one transfer
        scales = [vals.pop(("_scale", i)) for i in range(len(scales))]
        steps, now = max(vals.pop("_steps"), 1), self.clock()
        dt, self._last_emit_t = now - self._last_emit_t, now
        rec = {
            "step": meta["step"],
            "epoch": meta["epoch"],
            "loss": vals.pop("loss") / steps,
            "examples": meta["examples"],
            "examples_per_s": meta["examples"] / dt if dt > 0 else float("nan"),
            "global_rate": meta["epoch_examples"] / max(now - meta["epoch_t0"], 1e-9),
            "elapsed_s": now - self.t0,
            "lr": float(optimizer.param_groups[0]["lr"]),  # a 0-dim CPU tensor under torch.compile: no device read
        }
        wait, wall, n = meta["feed"]
        rec.update(data_wait_s=wait / n, step_s=wall / n, data_wait_frac=wait / wall if wall > 0 else 0.0)
        if isinstance(getattr(self, "feed_workers", None), int):  # the host loader's num_workers (0: this process)
            rec["data_workers"] = self.feed_workers
        if getattr(self, "feed_in_memory", False):
            rec["data_in_memory"] = True
        rec.update({k: v / steps for k, v in vals.items()})
        first_step = meta["step"] - len(losses) + 1
        if not math.isfinite(rec["loss"]) and self._problem is None:  # which step: read them one by one
            per_step = [float(t) for t in to_host(list(losses))]
            i = next((i for i, v in enumerate(per_step) if not math.isfinite(v)), 0)
            self._problem = f"loss became {per_step[i]} at step {first_step + i}"
        if scales:
            rec["skipped_steps"] = self._count_skips(scales, first_step)
        on_record(rec)

    def _count_skips(self, scales: list[float], first_step: int) -> int:
        skipped, limit = 0, self.cfg.max_skipped_steps
        for i, scale in enumerate(scales):
            skip = scale < self._last_scale
            skipped += skip
            self._skips_in_a_row = self._skips_in_a_row + 1 if skip else 0
            self._last_scale = scale
            if limit and self._skips_in_a_row >= limit and self._problem is None:
                self._problem = (
                    f"the GradScaler skipped {self._skips_in_a_row} steps in a row up to step {first_step + i} "
                    f"(inf/NaN gradients under a finite loss; loss scale now {scale:g}): the weights stopped changing"
                )
        return skipped
