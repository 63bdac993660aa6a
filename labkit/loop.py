"""A small training loop with named hooks, the same on TPU, GPU, XLA:CPU and CPU.

    trainer = Trainer(model, optimizer, rt, TrainConfig.from_env(), train_loader, eval_loader)
    history = trainer.fit()

Change behaviour by overriding one hook in a subclass, not by copying the loop:
  train_step(batch) -> loss    forward + backward (under bf16 autocast when cfg.bf16); may return
                               {"loss": t, "acc": t, ...}: extras are averaged into the records
  run_optimizer()              gradient reduction/clipping + step (labkit.optimizer_step)
  eval_step(batch) -> dict     summed device tensors, e.g. loss_sum, correct, count (uses loss_fn)
  on_log(record)               a dict of Python numbers every cfg.log_every steps (master only);
                               does nothing by default: overriding it never cuts callbacks off

Every step ends with `rt.sync()`. Losses are summed on the device and read only at log
time, inside a step closure: one device->host transfer per log interval, none per step.
Callbacks (e.g. labkit's Dashboard) may define on_train_begin, on_step_end (after each step's
sync, with the batch), on_log, on_eval, on_epoch_end and on_train_end, each taking the trainer
first; one dispatcher (`_dispatch`) calls the trainer's hook, then every callback. A callback
steers the run with `trainer.request_stop()` (stop after the current step; `after_epoch=True`:
after the current epoch, its evaluation and epoch-end save), `trainer.request_checkpoint()` (save
after the current step) and `trainer.request_profile(steps)` (capture the next steps' trace and
split their time: labkit.profiling; also SIGUSR1 or `touch profiles/PROFILE` from another shell).
Each finished capture goes out as on_profile(analysis).

Nothing fails silently: a loader error stops fit() with its own traceback (on XLA too, see
labkit.loader); a NaN/inf loss stops the run naming the step (cfg.continue_on_nonfinite to
train on); Ctrl-C or SIGTERM (a Colab interrupt, a preempted TPU VM) lets the pending checkpoint
upload finish (a second interrupt abandons it cleanly) and is then re-raised.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import signal
import threading
import time
import warnings

import torch
import torch.nn.functional as F

from labkit.accumulate import DeviceAccumulator, read, to_host
from labkit.checkpoint import CheckpointManager
from labkit.checkpoint.state import check_compatible
from labkit.config import TrainConfig
from labkit.loader import DeviceLoader
from labkit.optim import optimizer_step
from labkit.profiling import StepProfiler
from labkit.seeding import rng_state, set_rng_state
from labkit.versions import versions


class Preempted(KeyboardInterrupt):
    """SIGTERM arrived during fit() (a preempted TPU VM, a stopped container). A KeyboardInterrupt,
    so `except Exception` in user code does not swallow it."""


class Trainer:
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
        precision=None,
    ):
        self.rt, self.cfg = rt, cfg or TrainConfig()
        # labkit.precision.Precision: bf16 / fp16 (+ GradScaler) / fp32 per chip; None: cfg.bf16 as before
        self.precision = precision
        self.scaler = precision.grad_scaler() if precision is not None else None
        self.optimizer, self.scheduler = optimizer, scheduler
        self.model = _move_model(model, optimizer, rt.device)
        ddp = rt.kind in ("cuda", "cpu") and rt.world_size > 1  # torchrun: one process per GPU / CPU rank
        if ddp and not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # DDP all-reduces (averages) gradients during backward, so optimizer_step is a plain step there
            ids = [rt.device.index] if rt.kind == "cuda" else None
            self.model = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        self.module = getattr(self.model, "module", self.model)  # unwrapped: what checkpoints hold
        self.loss_fn = loss_fn or F.cross_entropy
        self.train_loader = self._wrap(train_loader)
        self.eval_loader = self._wrap(eval_loader) if eval_loader is not None else None
        self.callbacks = list(callbacks)
        self.checkpoint = checkpoint
        self.step = 0  # optimizer steps done
        self.epoch = 0  # current epoch
        self.batch_in_epoch = 0  # batches of the current epoch done
        self.history: list[dict] = []
        self.eval_history: list[dict] = []
        self._acc = DeviceAccumulator(rt)
        self._stop = self._stop_after_epoch = False
        self._save_requested = False
        self._nonfinite = None  # (step, loss) found by the log closure
        self.profiler = StepProfiler(rt)  # idle until a capture is requested: one attribute test per step

    def _wrap(self, loader):
        if loader is None or isinstance(loader, DeviceLoader):
            return loader
        return DeviceLoader(loader, self.rt)

    # -- hooks -----------------------------------------------------------------------------
    def autocast(self):
        """The forward pass's autocast: the Precision's when given, else bf16 when cfg.bf16."""
        return self.precision.autocast() if self.precision is not None else self.rt.autocast(self.cfg.bf16)

    def backward(self, loss) -> None:
        """loss.backward(), scaled first under fp16 (the GradScaler keeps small gradients from flushing to 0)."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def train_step(self, batch):
        x, y = batch
        with self.autocast():
            loss = self.loss_fn(self.model(x), y)
        self.backward(loss)
        return loss

    def run_optimizer(self):
        optimizer_step(self.optimizer, self.rt, clip_norm=self.cfg.clip_norm or None, scaler=self.scaler)
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

    # -- helpers -----------------------------------------------------------------------------
    def batch_size_of(self, batch) -> int:
        x = (
            batch[0]
            if isinstance(batch, (list, tuple))
            else next(iter(batch.values()))
            if isinstance(batch, dict)
            else batch
        )
        return int(x.shape[0])

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
        return len(self.train_loader)

    def total_steps(self) -> int:
        total = self.cfg.epochs * self.steps_per_epoch()
        return min(total, self.cfg.max_steps) if self.cfg.max_steps else total

    def request_stop(self, after_epoch: bool = False) -> None:
        """Stop after the current step (callable from any callback; position kept for a resume).
        after_epoch=True: finish the current epoch (its evaluation, on_epoch_end and epoch-end
        checkpoint included), then stop; a resume starts the next epoch."""
        if after_epoch:
            self._stop_after_epoch = True
        else:
            self._stop = True

    stop = request_stop  # older name

    def request_checkpoint(self) -> None:
        """Save a checkpoint after the current step, whatever checkpoint_every says (needs a
        CheckpointManager; without one the request warns and is dropped)."""
        self._save_requested = True

    def request_profile(self, steps: int = 5, out_dir: str | None = None) -> None:
        """Profile the next `steps` training steps of the running (or next) fit(): a trace in its own
        folder under out_dir (default $LABKIT_PROFILE_DIR or ./profiles) and an analysis, appended to
        self.profiles when the capture ends. See labkit.profiling."""
        self.profiler.request(steps, out_dir)

    @property
    def profiles(self) -> list:
        """labkit.profiling.Analysis of each finished capture, oldest first."""
        return self.profiler.results

    # -- state (what a checkpoint holds) ---------------------------------------------------
    def state_dict(self) -> dict:
        state = {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "config": self.cfg.to_dict(),
            "rng": rng_state(self.rt),
            "versions": versions(),
        }
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        check_compatible(state["model"], self.module)  # names the first mismatched key
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        if "rng" in state:  # dropout/augmentation draws continue exactly where they stopped
            set_rng_state(state["rng"], self.rt)

    # -- the loop --------------------------------------------------------------------------
    def _log_due(self, now: float) -> bool:
        c = self.cfg
        if c.log_every and self.step % c.log_every == 0:
            return True
        return bool(c.log_seconds) and now - self._last_log_t >= c.log_seconds

    def _emit(self, sums: dict, meta: dict) -> None:
        """Runs in a step closure (after the step executed): reads the sums, builds the record.
        The per-step losses come back in the one transfer that reading needs anyway, so the
        NaN/inf check below costs no host sync of its own."""
        losses = sums.pop("loss", [])
        vals = read({"loss": losses, **sums})
        now = time.perf_counter()
        steps = vals.pop("_steps")
        examples = meta["examples"]
        dt = now - self._last_emit_t
        self._last_emit_t = now
        rec = {
            "step": meta["step"],
            "epoch": meta["epoch"],
            "loss": vals.pop("loss") / max(steps, 1),
            "examples": examples,
            "examples_per_s": examples / dt if dt > 0 else float("nan"),
            "global_rate": meta["epoch_examples"] / max(now - self._epoch_t0, 1e-9),
            "elapsed_s": now - self._t0,
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        rec.update({k: v / max(steps, 1) for k, v in vals.items()})
        if not math.isfinite(rec["loss"]) and self._nonfinite is None:
            # which step: the interval's per-step values are already on the host (read() summed them)
            per_step = [float(t) for t in _host(losses)]
            first = next((i for i, v in enumerate(per_step) if not math.isfinite(v)), 0)
            self._nonfinite = (meta["step"] - len(per_step) + first + 1, per_step[first])
        self.history.append(rec)
        self._dispatch("on_log", rec)

    def evaluate(self) -> dict:
        """Run eval_step over the eval loader; sums are reduced across replicas and read once."""
        if self.eval_loader is None:
            return {}
        self.model.eval()
        totals: dict = {}
        with torch.no_grad():
            for batch in self.eval_loader:
                for k, v in self.eval_step(batch).items():
                    totals[k] = totals[k] + v.float() if k in totals else v.float()
                self.rt.sync()
        self.model.train()
        totals = {k: self.rt.all_reduce(v, "sum") for k, v in totals.items()}
        self.rt.sync()
        vals = read(totals)  # one transfer, once per evaluation
        count = max(vals.pop("count", 0), 1)
        out = {"step": self.step, "epoch": self.epoch}
        if "loss_sum" in vals:
            out["val_loss"] = vals.pop("loss_sum") / count
        if "correct" in vals:
            out["val_acc"] = vals.pop("correct") / count
        out.update(vals)
        self.eval_history.append(out)
        self._dispatch("on_eval", out)
        return out

    def fit(self) -> list[dict]:
        """Train to cfg.epochs / cfg.max_steps; returns the logged records. Interrupts (Ctrl-C,
        SIGTERM) and errors first let the pending checkpoint upload finish, then propagate."""
        c, rt = self.cfg, self.rt
        self._check_optimizer()
        if c.resume and self.checkpoint is not None:
            if getattr(self.checkpoint, "restores_in_place", False):
                # a sharded checkpoint loads into the live tensors, which keep their sharding; the
                # filled template then goes through load_state_dict like any restored state
                template = self.state_dict()
                state = template if self.checkpoint.restore(template) is not None else None
            elif isinstance(self.checkpoint, CheckpointManager):  # a sharded-format step fills the template
                state = self.checkpoint.restore(into=self.state_dict())
            else:
                state = self.checkpoint.restore()
            if state is not None:
                self.load_state_dict(state)
                rt.master_print(
                    f"[labkit] resumed at step {self.step} (epoch {self.epoch}, batch {self.batch_in_epoch})"
                )
        self.model.train()
        self._t0 = self._last_emit_t = self._last_log_t = time.perf_counter()
        self._stop = self._stop_after_epoch = self._save_requested = False
        self._nonfinite = None
        prof = self.profiler
        prof.install_signal()
        with _sigterm_raises():
            try:
                self._dispatch("on_train_begin")
                prof.step_boundary(self)  # a capture requested before fit() starts with its first step
                total = self.total_steps()
                while self.epoch < c.epochs and self.step < total and not self._stop:
                    self._run_epoch(total)
                    if self._stop or self.step >= total and self.batch_in_epoch < self.steps_per_epoch():
                        break  # stopped mid-epoch: keep epoch/batch position for an exact resume
                    if c.eval_every and self.eval_loader is not None and (self.epoch + 1) % c.eval_every == 0:
                        self.evaluate()
                    self._dispatch("on_epoch_end")
                    if self.checkpoint is not None and not c.checkpoint_every:
                        # documented: 0 means "at each epoch end"; the position is the next epoch's start
                        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                        self.checkpoint.save(self.step, self.state_dict(), metrics=self._last_metrics())
                    else:
                        self.epoch, self.batch_in_epoch = self.epoch + 1, 0
                    if self._stop_after_epoch:
                        break
                self._dispatch("on_train_end")
            except KeyboardInterrupt as e:
                self._finish_pending_save(e)
                raise
            except BaseException:
                self._finish_pending_save(None)
                raise
            finally:
                prof.remove_signal()
                self._finish_profile()
            self._finish_pending_save(None, raise_errors=True)
        return self.history

    def _finish_pending_save(self, interrupt, raise_errors: bool = False) -> None:
        """The last upload finishes (or raises) before fit returns. Interrupted: say so, wait for it
        (a second interrupt abandons it cleanly: no pointer move, temp file removed)."""
        ck = self.checkpoint
        if ck is None:
            return
        if interrupt is not None and getattr(ck, "pending", None):
            what = "SIGTERM" if isinstance(interrupt, Preempted) else "interrupt"
            self.rt.master_print(
                f"[labkit] {what} at step {self.step}: finishing the pending checkpoint upload "
                "(interrupt again to abandon it)"
            )
        try:
            if hasattr(ck, "close"):
                ck.close()
            elif hasattr(ck, "wait"):
                ck.wait()
        except Exception as e:
            if raise_errors:
                raise
            warnings.warn(f"the pending checkpoint save failed too: {type(e).__name__}: {e}", stacklevel=2)

    def _finish_profile(self) -> None:
        """fit() ended inside a capture window: keep the steps captured so far."""
        n = len(self.profiler.results)
        try:
            self.profiler.finish()
        except Exception as e:  # a failed analysis must not hide how fit() ended
            warnings.warn(f"profile capture could not be finished: {type(e).__name__}: {e}", stacklevel=2)
        self._announce_profiles(n)

    def _announce_profiles(self, before: int) -> None:
        for a in self.profiler.results[before:]:
            m = a.mean()
            split = " ".join(
                f"{k[:-2]} {100 * v / max(m['total_s'], 1e-12):.0f}%" for k, v in m.items() if k != "total_s"
            )
            self.rt.master_print(f"[labkit] profiled {len(a.steps)} steps -> {a.folder} ({split})")
            self._dispatch("on_profile", a)

    def _check_optimizer(self) -> None:
        for i, g in enumerate(self.optimizer.param_groups):
            lr = g.get("lr")
            if isinstance(lr, (int, float)) and not (math.isfinite(lr) and lr >= 0):
                raise ValueError(f"optimizer param group {i} has lr={lr!r}: expected a finite number >= 0")
        if self.train_loader is not None and self.steps_per_epoch() == 0 and self.cfg.epochs:
            raise ValueError(
                "the train loader yields no batches (fewer samples than one batch, and partial "
                "batches are dropped for static shapes): lower the batch size or add data"
            )

    def _raise_if_nonfinite(self) -> None:
        bad, self._nonfinite = self._nonfinite, None
        if bad is None:
            return
        step, value = bad
        msg = (
            f"loss became {value} at step {step} (seen at the log of step {self.step}): lower the learning rate, "
            "add clip_norm, or check the data"
        )
        if self.cfg.continue_on_nonfinite:
            warnings.warn(msg + "; training on (continue_on_nonfinite=True)", RuntimeWarning, stacklevel=2)
            return
        raise FloatingPointError(msg + " (TrainConfig.continue_on_nonfinite=True trains on)")

    def _run_epoch(self, total: int) -> None:
        c, rt = self.cfg, self.rt
        loader = self.train_loader
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.epoch)
        skip = self.batch_in_epoch
        if skip:  # resuming mid-epoch: the same epoch order, minus what was done
            rt.master_print(f"[labkit] skipping {skip} batches of epoch {self.epoch} already trained")
            if isinstance(loader, DeviceLoader):
                loader.skip_batches = skip  # skipped on the host, never copied to the device
        batches = iter(loader)
        if skip and not isinstance(loader, DeviceLoader):
            batches = itertools.islice(batches, skip, None)
        self._epoch_t0 = time.perf_counter()
        epoch_examples = 0
        interval_examples = 0
        prof = self.profiler
        batches = iter(batches)
        while True:
            if prof.capturing:  # data wait is timed only inside a capture window
                prof.before_batch()
            batch = next(batches, _END)
            if batch is _END:
                break
            if prof.capturing:
                prof.after_batch()
            n = self.batch_size_of(batch)
            loss = self.train_step(batch)
            extra = {}
            if isinstance(loss, dict):  # {"loss": ..., "acc": ...}: extras are averaged per interval too
                extra = {k: v for k, v in loss.items() if k != "loss"}
                loss = loss["loss"]
            self.run_optimizer()
            self._acc.add(loss=loss.detach(), **extra)
            self.step += 1
            self.batch_in_epoch += 1
            epoch_examples += n * rt.world_size
            interval_examples += n * rt.world_size
            now = time.perf_counter()
            if self._log_due(now) or self.step >= total:
                sums = self._acc.take()
                self._last_log_t = now
                if rt.is_master:  # only the master reads and draws
                    meta = {
                        "step": self.step,
                        "epoch": self.epoch,
                        "examples": interval_examples,
                        "epoch_examples": epoch_examples,
                    }
                    rt.add_step_closure(self._emit, args=(sums, meta))
                interval_examples = 0
            if prof.capturing:
                prof.before_sync()
            rt.sync()  # ends the step: the graph runs, closures run after it
            if prof.capturing:
                prof.after_sync(self.step)  # waits for the device: captured steps only
            self._raise_if_nonfinite()  # before any save: never checkpoint weights a NaN loss produced
            self._dispatch("on_step_end", batch)  # host-side only (e.g. the dashboard notes batch shapes)
            periodic = c.checkpoint_every and self.step % c.checkpoint_every == 0
            if self._save_requested or periodic:
                self._save_requested = False
                if self.checkpoint is None:
                    warnings.warn("request_checkpoint() ignored: this Trainer has no CheckpointManager", stacklevel=2)
                else:
                    self.checkpoint.save(self.step, self.state_dict(), metrics=self._last_metrics(), force=not periodic)
            n_profiles = len(prof.results)
            prof.step_boundary(self)  # closes a captured step, polls the trigger file (os.stat, <= 1/s)
            if len(prof.results) > n_profiles:
                self._announce_profiles(n_profiles)
            if self.step >= total or self._stop:
                break

    def _last_metrics(self) -> dict:
        return dict(self.eval_history[-1]) if self.eval_history else {}


_END = object()


def _host(tensors):
    return to_host(list(tensors))


@contextlib.contextmanager
def _sigterm_raises():
    """During fit, SIGTERM raises Preempted in the main thread (its default action kills the
    process on the spot, losing the pending upload). Elsewhere (a worker thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
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


def _move_model(model, optimizer, device):
    """Move the model to the device; if that replaced the Parameter objects (CPU -> XLA does),
    point the optimizer at the new ones so an optimizer built before the move still trains."""
    before = list(model.parameters())
    model = model.to(device)
    after = list(model.parameters())
    remap = {id(a): b for a, b in zip(before, after) if a is not b}
    if remap and optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [remap.get(id(p), p) for p in group["params"]]
        moved = {}
        for p, st in optimizer.state.items():
            moved[remap.get(id(p), p)] = {
                k: v.to(device) if torch.is_tensor(v) and v.dim() else v for k, v in st.items()
            }
        optimizer.state.clear()
        optimizer.state.update(moved)
    return model


def count_params(model) -> int:
    """Number of scalars in the model's parameters (shared parameters counted once)."""
    return sum(p.numel() for p in model.parameters())


def chance_accuracy(num_classes: int) -> float:
    """Accuracy of guessing uniformly: what a trained classifier must clearly beat."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    return 1.0 / num_classes
