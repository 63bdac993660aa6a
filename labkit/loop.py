"""A small training loop with named hooks, the same on TPU, GPU, XLA:CPU and CPU.

    trainer = Trainer(model, optimizer, rt, TrainConfig.from_env(), train_loader, eval_loader)
    history = trainer.fit()

One step, as `_run_epoch` spells it out: train_step (forward + backward) -> run_optimizer -> add the loss to the
device-side sums -> at log time, a closure that reads them -> rt.sync() -> housekeeping. Change behaviour by
overriding one hook in a subclass, not by copying the loop:
  train_step(batch) -> loss    forward + backward under the Precision's autocast; may return
                               {"loss": t, "acc": t, ...}: extras are averaged into the records
  run_optimizer()              gradient reduction/clipping + step (labkit.optimizer_step)
  eval_step(batch) -> dict     summed device tensors, e.g. loss_sum, correct, count (uses loss_fn)
  on_log(record)               Python numbers every cfg.log_every steps (master only); a no-op: callbacks still run

The step is captured as the runtime says (labkit.runtime.step, TrainConfig.compile): off XLA, a torch.compile'd
model and optimizer step where the run's steps repay the compile; the hooks read the same either way.

Gradient accumulation (cfg.accum_steps = k): k train_steps (each loss divided by k) per run_optimizer, so .grad adds up
to the gradient of the k-times larger batch; under torchrun only the last one reduces (labkit.parallel). `step` and what
cfg counts in steps are optimizer steps; checkpoints fall only between them (a resumed run trains at most k - 1
micro-batches again); an epoch's last len(loader) % k batches are dropped, as a short batch is (said once).

Every step ends with `rt.sync()`. Losses are summed on the device, read at log time in a step closure: one device->host
transfer per log interval, none per step. Callbacks (e.g. labkit's Dashboard) may define on_train_begin, on_step_end
(after each step's sync, with the batch), on_log, on_eval, on_epoch_end, on_train_end, on_profile and on_fit_end
(returned or raised: undo hooks put on torch or Python), each taking the trainer first; `_dispatch` calls the trainer's
hook, then every callback's. They steer the run with `trainer.request_stop()` (`after_epoch=True`: after this epoch's
evaluation and save), `request_checkpoint()` and `request_profile(steps)` (labkit.profiling).

Nothing fails silently: a loader error stops fit() with its traceback; a NaN/inf loss, or fp16 steps the GradScaler
keeps skipping, stop the run naming the step (cfg.continue_on_nonfinite to train on); a resume on another batch size,
chip count or optimizer continues at the same sample or says why not (labkit.resume); Ctrl-C or SIGTERM lets the pending
upload finish, then is re-raised; torchrun: SIGTERM, a NaN or a callback's stop or save request on one process is
every process's at one step, or at the epoch's end (labkit.interrupts.vote).
"""

from __future__ import annotations

import itertools
import warnings

import torch
import torch.nn.functional as F

from labkit import meta_init, resume
from labkit.accumulate import mean_of, read
from labkit.config import TrainConfig
from labkit.interrupts import Preempted, Requests, StepVote, finish_pending_save, sigterm_raises
from labkit.interrupts.vote import same_everywhere, trainer_settings
from labkit.loader import DeviceLoader, as_device_loader, batch_rows
from labkit.optim import check_lr, move_model, optimizer_step
from labkit.parallel import choose as choose_plan
from labkit.precision import Precision, choose
from labkit.profiling import StepProfiler
from labkit.runtime.step import planned_steps
from labkit.steplog import StepLog

__all__ = ["Preempted", "Trainer"]


class Trainer(Requests):
    def __init__(
        self,
        model,
        optimizer,
        rt,
        cfg: TrainConfig | None = None,
        train_loader=None,
        eval_loader=None,
        scheduler=None,
        loss_fn=None,
        callbacks=(),
        checkpoint=None,
        precision: Precision | None = None,
    ):
        self.rt, self.cfg = rt, cfg or TrainConfig()
        # labkit.precision.choose(rt, "auto" | "bf16" | "fp16" | "fp32"); None: fp32. Its own copy: under fp16 the
        # loss scale (a GradScaler's) is this run's state
        self.precision = (precision or choose(rt, "fp32")).fresh()
        self.optimizer, self.scheduler = optimizer, scheduler
        # on the device (a meta-built model gets its memory from the plan, sharded), laid out by the run's plan
        train_loader = as_device_loader(train_loader, rt)  # its len(): this process's batches, a short one dropped
        cfg, steps = self.cfg, planned_steps(self.cfg, train_loader)  # "auto" compiles where the steps repay it
        self.plan = choose_plan(rt, cfg.parallel, self.precision, model, cfg.fsdp_accumulate, cfg.accum_steps)
        model = model if meta_init.is_meta(model) else move_model(model, optimizer, rt.device)
        self.layout = rt.choose_layout(model, cfg.memory_format)  # channels_last on CUDA (labkit.runtime.layout)
        model = self.layout.apply(model, optimizer) if self.plan.weights_in_layout else model  # FSDP2: contiguous
        model = self.plan.wrap(model, optimizer)
        self.module = getattr(model, "module", model)  # DDP unwrapped, never compiled: what checkpoints hold
        # how the step is captured (labkit.runtime.step): torch.compile'd model and optimizer step, or as written
        self.capture = rt.step_capture(cfg.compile, cfg.compile_backend, steps)
        self.capture.prepare(optimizer)
        self.model = self.capture.model(model)
        self._optimizer_step = self.capture.function(optimizer_step)
        self.loss_fn = loss_fn or F.cross_entropy
        self.train_loader, self.eval_loader = self._wrap(train_loader, train=True), self._wrap(eval_loader)
        self.callbacks, self.checkpoint = list(callbacks), checkpoint
        # optimizer steps done; the current epoch and its batches done; the last batch (evaluation's padding, torchrun)
        self.step, self.epoch, self.batch_in_epoch, self._last_batch = 0, 0, 0, None
        self.history, self.eval_history = [], []  # the logged records; one per evaluation
        self.log = StepLog(rt, self.cfg, self.precision)  # losses summed on the device, read once per interval
        self._stop = self._stop_after_epoch = self._save_requested = False
        self._step_offset = 0  # steps trained at another batch size before a resume (see total_steps)
        self._master_only = False  # inside on_log (process 0 only)
        self.profiler, self.vote = StepProfiler(rt), StepVote(rt)  # idle until asked; torchrun: SIGTERM and NaN
        same_everywhere(rt, trainer_settings(self), "the Trainer's settings")  # torchrun: alike, or all raise now

    def _wrap(self, loader, train=False):  # images in the model's memory format; CUDA tunes cuDNN for train's shapes
        if (loader := as_device_loader(loader, self.rt)) is not None:
            loader.layout = self.layout
            if train:
                self.rt.autotune(loader.drop_partial)
        return loader

    # -- hooks -----------------------------------------------------------------------------
    def autocast(self):
        """The forward pass's autocast context (a no-op one for fp32)."""
        return self.precision.autocast()

    def backward(self, loss) -> None:
        """loss.backward(), scaled first under fp16 (the GradScaler keeps small gradients from flushing to 0). With
        cfg.accum_steps = k > 1 the mean loss is divided by k: the k gradients add up to the k-times batch's mean's."""
        k = self.cfg.accum_steps
        self.precision.backward(loss / k if k > 1 else loss)

    def train_step(self, batch):
        x, y = batch
        with self.autocast():
            loss = self.loss_fn(self.model(x), y)
        self.backward(loss)
        return loss

    def run_optimizer(self):
        self._optimizer_step(self.optimizer, self.rt, clip_norm=self.cfg.clip_norm or None, precision=self.precision)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def eval_step(self, batch) -> dict:
        x, y = batch
        with self.autocast():
            out = self.model(x)
        loss = self.loss_fn(out.float(), y, reduction="sum")
        correct = (out.argmax(dim=-1) == y).sum()
        # labels < 0 are padding (data_tools pads the last eval batch with -100, cross_entropy's
        # ignore_index, to keep shapes static): they add no loss, no hit and no count
        return {"loss_sum": loss, "correct": correct, "count": (y >= 0).sum()}

    def on_log(self, record: dict) -> None:
        """Hook: override to act on each record; callbacks are fed by _dispatch either way."""

    # -- the loop --------------------------------------------------------------------------
    def _run_epoch(self, total: int) -> None:
        batches = self.profiler.timed(self._epoch_batches())  # times the data wait while profiling
        batches = self.log.timed(batches, self.train_loader)  # the feed meter: each step's wait for its batch
        k, micro = self.cfg.accum_steps, []  # accumulation: k micro-batches per optimizer step
        left = (self.steps_per_epoch() - self.batch_in_epoch) * k if k > 1 else None  # the last len % k: not trained
        for batch in itertools.islice(batches, left):
            with self.plan.gradient_sync(len(micro) == k - 1):  # only the last micro-batch reduces gradients
                micro.append(self.train_step(batch))  # forward + backward: only recorded on XLA, nothing runs yet
            if len(micro) < k:  # gradients add up in .grad; the micro-step's graph ends here, the same one each time
                self.rt.sync()
                continue
            self.run_optimizer()  # reduce gradients across replicas, clip, step, zero_grad
            loss, micro = (micro[0] if k == 1 else mean_of(micro)), []  # k > 1: the mean of the k micro-batch losses
            self.log.add(loss, rows=self.batch_size_of(batch) * self.rt.world_size * k)  # device-side sums: no sync
            self.step, self.batch_in_epoch = self.step + 1, self.batch_in_epoch + 1
            if self.log.due(self.step, total):  # read after the step ran, in a closure: one transfer
                self.log.close(self.step, self.epoch, self.optimizer, self._record)
            with self.profiler.around_sync(self.step):  # a captured step also waits for the device
                self.rt.sync()  # the step ends: its graph is cut, compiled (first time only) and launched
            self._after_step(batch)  # NaN check, callbacks, checkpoint, profiler boundary
            if self.step >= total or self._stop:
                break

    def fit(self) -> list[dict]:
        """Train to cfg.epochs / cfg.max_steps; returns the logged records. Interrupts (Ctrl-C,
        SIGTERM) and errors first let the pending checkpoint upload finish, then propagate."""
        c = self.cfg
        self._check_inputs()
        if c.resume and self.checkpoint is not None:
            resume.restore(self)  # the newest committed step, if any (labkit.resume)
        self.model.train()
        self.log.begin_fit()
        self._stop = self._stop_after_epoch = self._save_requested = False
        self.vote.asked.clear()
        self.profiler.install_signal()
        with sigterm_raises(self.vote):
            try:
                self._dispatch("on_train_begin")
                self._announce(self.profiler.boundary(self))  # a capture requested before fit() starts now
                total = self.total_steps()
                while self.epoch < c.epochs and self.step < total and not self._stop:
                    self._run_epoch(total)
                    if self._stop or self.step >= total and self.batch_in_epoch < self.steps_per_epoch():
                        break  # stopped mid-epoch: keep epoch/batch position for an exact resume
                    if c.eval_every and self.eval_loader is not None and (self.epoch + 1) % c.eval_every == 0:
                        self.evaluate()
                    self._dispatch("on_epoch_end")
                    self._epoch_end()  # the next epoch's position; a save or stop asked meanwhile acts here
                    if self._stop_after_epoch:
                        break
                if self.log.open_steps:  # the steps since the last record (a stop, or a run shorter than planned)
                    self.log.close(self.step, self.epoch, self.optimizer, self._record)
                    self.rt.sync()  # its closure runs: the record is in history before on_train_end
                self._dispatch("on_train_end")
            except KeyboardInterrupt as e:
                finish_pending_save(self.checkpoint, self.rt, self.step, interrupt=e)
                raise
            except BaseException:
                finish_pending_save(self.checkpoint, self.rt, self.step)
                raise
            finally:
                self.profiler.remove_signal()
                self._announce(self.profiler.finish_quietly())  # fit() ended inside a capture: keep its steps
                self._dispatch("on_fit_end")  # returned or raised: callbacks take back the hooks they added
            finish_pending_save(self.checkpoint, self.rt, self.step, raise_errors=True)
        return self.history

    def evaluate(self) -> dict:
        """Run eval_step over the eval loader; sums are reduced across replicas and read once."""
        if self.eval_loader is None:
            return {}
        self.plan.sync_buffers(self.module)  # torchrun: process 0's BatchNorm statistics on every process
        self.model.eval()
        totals: dict = {}
        with torch.no_grad():
            # torchrun: as many forwards on every process (FSDP2's all-gather); padding ones count nothing
            for batch, real in self.plan.lockstep(self.eval_loader, spare=self._last_batch):
                for k, v in self.eval_step(batch).items():
                    v = v.float() if real else torch.zeros_like(v, dtype=torch.float32)  # the keys, all-reduced below
                    totals[k] = totals[k] + v if k in totals else v
                self.rt.sync()
        self.model.train()
        totals = {k: self.rt.all_reduce(v, "sum") for k, v in totals.items()}
        self.rt.sync()
        vals = read(totals)  # one transfer, once per evaluation
        count = max(vals.pop("count", 0), 1)
        means = {"loss_sum": "val_loss", "correct": "val_acc"}  # sums over the counted samples -> means
        out = {"step": self.step, "epoch": self.epoch, **{means[k]: vals.pop(k) / count for k in means if k in vals}}
        out.update(vals)
        self.eval_history.append(out)
        self._dispatch("on_eval", out)
        return out

    # -- the step's parts, in the order the loop calls them ----------------------------------
    def _epoch_batches(self):
        """This epoch's batches; resuming mid-epoch, the same order minus what was trained."""
        loader, skip = self.train_loader, self.batch_in_epoch
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.epoch)
        self.log.begin_epoch()
        if not skip:
            return loader
        self.rt.master_print(f"[labkit] skipping {skip} batches of epoch {self.epoch} already trained")
        # a DeviceLoader (see _wrap): skipped on the host, never copied to the device; k micro-batches per step
        loader.skip_batches = skip * self.cfg.accum_steps
        return loader

    def _after_step(self, batch) -> None:
        self._last_batch = batch
        self._dispatch("on_step_end", batch)  # host-side only (e.g. the dashboard notes batch shapes)
        # torchrun: one vote a step makes SIGTERM, a NaN and a callback's stop or save on any process every process's;
        # a NaN raises before any save (NaN weights)
        self.log.raise_problem(self.step, self._share_requests(self.log.take_problem()))
        self._save_requested |= self.vote.agreed_on  # SIGTERM to any process -> all save this step
        periodic = self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0
        if self._save_requested or periodic:
            self._save_requested = False
            if self.checkpoint is None:
                warnings.warn("request_checkpoint() ignored: this Trainer has no CheckpointManager", stacklevel=3)
            else:
                self.checkpoint.save(self.step, self.state_dict(), metrics=self._last_metrics(), force=not periodic)
        self.vote.stop_if_agreed(self.step)  # then Preempted on every process: fit() waits for the save
        self._announce(self.profiler.boundary(self))  # closes a captured step, polls the trigger file

    def _record(self, rec: dict) -> None:
        self.history.append(rec)
        self._master_only = True  # torchrun: on_log runs on process 0 alone (state_dict refuses to run there)
        try:
            self._dispatch("on_log", rec)
        finally:
            self._master_only = False

    # -- helpers -----------------------------------------------------------------------------
    def batch_size_of(self, batch) -> int:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        x = next(iter(x.values())) if isinstance(x, dict) else x
        return int(x.shape[0])

    def global_batch(self) -> int | None:
        """Samples per optimizer step over all replicas: the loader's batch_size (or its dataset's: a shard stream
        batches itself) x world size x accum_steps, else the last step's (None before the first step)."""
        bs = batch_rows(self.train_loader)
        return bs * self.rt.world_size * self.cfg.accum_steps if bs else self.log.last_rows

    def _dispatch(self, name: str, *args) -> None:
        """The one place events go out: the trainer's own hook of that name (if any), then every
        callback that defines it (called with the trainer first)."""
        hook = getattr(self, name, None)
        if callable(hook):
            hook(*args)
        for cb in self.callbacks:
            fn = getattr(cb, name, None)
            if fn is not None:
                fn(self, *args)

    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch: the loader's batches // accum_steps (a last partial accumulation is dropped,
        as the loader drops a short batch: every step averages the same number of samples)."""
        return len(self.train_loader) // self.cfg.accum_steps

    def total_steps(self) -> int:
        """cfg.epochs x steps_per_epoch (capped by cfg.max_steps), plus the steps a resumed run took at
        another batch size: the optimizer step counter goes on, the epochs count samples."""
        total = self.cfg.epochs * self.steps_per_epoch() + self._step_offset
        return min(total, self.cfg.max_steps) if self.cfg.max_steps else total

    def request_profile(self, steps: int = 5, out_dir: str | None = None) -> None:
        """Profile the next `steps` training steps of the running (or next) fit(): a trace in its own
        folder under out_dir (default $LABKIT_PROFILE_DIR or ./profiles) and an analysis, appended to
        self.profiles when the capture ends. See labkit.profiling."""
        self.profiler.request(steps, out_dir)

    @property
    def profiles(self) -> list:
        """labkit.profiling.Analysis of each finished capture, oldest first."""
        return self.profiler.results

    def _announce(self, analyses) -> None:
        for a in analyses:
            self.rt.master_print(f"[labkit] {self.profiler.describe(a)}")
            self._dispatch("on_profile", a)

    def _check_inputs(self) -> None:
        check_lr(self.optimizer)
        if self.train_loader is not None and self.steps_per_epoch() == 0 and self.cfg.epochs:
            raise ValueError(
                f"the train loader yields no batches for one optimizer step ({len(self.train_loader)} batches, "
                f"accum_steps={self.cfg.accum_steps}; fewer samples than one batch, and partial batches are dropped "
                "for static shapes): lower the batch size or accum_steps, or add data"
            )
        if self.cfg.epochs and isinstance(self.train_loader, DeviceLoader):  # once per fit(): nothing left unsaid
            self.train_loader.say_leftovers(self.cfg.accum_steps, self.rt.world_size)

    def _last_metrics(self) -> dict:
        return dict(self.eval_history[-1]) if self.eval_history else {}

    # -- state (what a checkpoint holds: model, optimizer, step, data position, RNG; labkit.resume) ---------
    def state_dict(self) -> dict:
        """What a checkpoint holds (labkit.resume.trainer_state). Under torchrun a collective: it makes BatchNorm's
        statistics equal and gathers every process's RNG state, so every process calls it at the same point, as
        `checkpoint.save(step, trainer.state_dict())` on every process does. `if rt.is_master:
        torch.save(trainer.state_dict(), path)` would wait for the others for ever (under FSDP2 it would also hold
        only process 0's shards: save through a CheckpointManager). Called from on_log, which runs on process 0
        alone, it raises RuntimeError instead of hanging."""
        return resume.trainer_state(self)

    def load_state_dict(self, state: dict) -> None:
        resume.load_trainer_state(self, state)
