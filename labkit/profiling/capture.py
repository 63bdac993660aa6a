"""Profile a few steps of a running fit(), then split each step's time (labkit.profiling.analysis).

    trainer.request_profile(steps=5)          # from a callback, a notebook cell, a dashboard button
    ...                                       # the next 5 steps are captured; then, in the run's folder:
    a = trainer.profiles[-1]                  # an Analysis: a.table(), a.top_ops(), a.timeline()
    a = labkit.profiling.analyze("profiles/step000120-20261123-201500")   # the same, read back from disk

From a script, without touching its code: `kill -USR1 <pid>` (SIGUSR1, installed during fit() only in the
main thread and only when nothing else handles it) or `touch profiles/PROFILE` (the trigger file:
$LABKIT_PROFILE_TRIGGER, else <out_dir>/PROFILE; it may hold a step count; polled with one os.stat at most
once a second, and removed when seen). The folder is $LABKIT_PROFILE_DIR, else ./profiles.

What a capture costs: nothing until one is requested (one attribute test per step and the once-a-second
stat; no device sync). During the N captured steps, each step ends with a wait for the device
(xm.wait_device_ops on XLA, torch.cuda.synchronize on a GPU) so that a step's work stays inside its step:
captured steps run a little slower than free-running ones, whose host and device overlap. Measured by
bench/bench_profile.py on 2 loaded cores: 1.4-1.8 us per step idle; a captured XLA:CPU MLP step 1.22x a free one.
The capture's end (stop, analysis, timeline PNG) takes ~0.2-1 s of the step that ends it.

What is captured, per backend:
- XLA (TPU, XLA:CPU): torch_xla.debug.profiler's in-process session (`xp.start_trace`/`xp.stop_trace`; the
  older `xp.start_server` + `xp.trace_detached` needs a server and a client thread and is not needed in
  the process itself). It writes `plugins/profile/<run>/<host>.xplane.pb`, which TensorBoard's profile
  plugin and XProf open (`tensorboard --logdir <capture folder>`; labkit.profiling.viewers says how, on
  Colab too), and beside it `<host>.trace.json.gz`,
  the same events as a Chrome trace, which is what labkit reads (no XPlane parser is installed here).
  torch_xla-specific.
- CPU and CUDA: torch.profiler, exported as a Chrome/Perfetto JSON trace (open it at ui.perfetto.dev).

The split itself (categories, top ops, timeline) is labkit.profiling.analysis.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import warnings
from pathlib import Path

from labkit import _xla
from labkit.profiling.analysis import STEP_SPAN, Analysis, analyze

SIGNAL = "SIGUSR1"


def default_dir() -> Path:
    return Path(os.environ.get("LABKIT_PROFILE_DIR") or "profiles")


def trigger_path(out_dir=None) -> Path:
    """Where `touch` starts a capture: $LABKIT_PROFILE_TRIGGER, else <out_dir>/PROFILE."""
    env = os.environ.get("LABKIT_PROFILE_TRIGGER")
    return Path(env) if env else Path(out_dir or default_dir()) / "PROFILE"


def _check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"profile steps={steps!r}: expected a whole number >= 1")
    return steps


class StepProfiler:
    """The Trainer's part: it owns one, calls it at step boundaries and never otherwise."""

    poll_every_s = 1.0

    def __init__(self, rt, out_dir=None):
        self.rt, self.out_dir = rt, out_dir
        self.capturing = False  # the one attribute the loop tests each step
        self._request = None  # (steps, out_dir) waiting for the next step boundary
        self._last_poll = -1e9
        self._old_handler = None
        self.results: list[Analysis] = []

    # -- requests ----------------------------------------------------------------------------------
    def request(self, steps: int = 5, out_dir=None) -> None:
        self._request = (_check_steps(steps), out_dir)  # a plain assignment: safe from a signal handler

    def install_signal(self) -> None:
        """SIGUSR1 requests a capture, during fit() only, main thread only, never over someone's handler."""
        sig = getattr(signal, SIGNAL, None)
        if sig is None or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(sig) not in (signal.SIG_DFL, None):
            return
        try:
            self._old_handler = signal.signal(sig, lambda signum, frame: self.request())
        except (ValueError, OSError):
            self._old_handler = None

    def remove_signal(self) -> None:
        if self._old_handler is not None:
            signal.signal(getattr(signal, SIGNAL), self._old_handler)
            self._old_handler = None

    def _poll_trigger(self) -> None:
        path = trigger_path(self.out_dir)
        try:
            os.stat(path)
        except OSError:
            return
        try:
            text = path.read_text().strip()
            path.unlink()
        except OSError:
            return
        try:
            self.request(int(text) if text else 5)
        except ValueError:
            warnings.warn(f"profile trigger {path} holds {text!r}: expected a step count or nothing", stacklevel=3)

    # -- called by the Trainer -----------------------------------------------------------------------
    def timed(self, batches):
        """Yields the batches; inside a capture window it also times the wait for each one (the data
        part of the step's split). Outside one: one attribute test per batch."""
        it = iter(batches)
        while True:
            if self.capturing:
                self.before_batch()
            try:
                batch = next(it)
            except StopIteration:
                return
            if self.capturing:
                self.after_batch()
            yield batch

    @contextlib.contextmanager
    def around_sync(self, step: int):
        """Wraps rt.sync(), the end of every step. A captured step also waits for the device afterwards, so
        its work stays inside its own step (free-running steps overlap host and device)."""
        if not self.capturing:
            yield
            return
        self.before_sync()
        yield
        self.after_sync(step)

    def boundary(self, trainer) -> list[Analysis]:
        """step_boundary(), returning the analyses that finished there (the Trainer announces them)."""
        n = len(self.results)
        self.step_boundary(trainer)
        return self.results[n:]

    def step_boundary(self, trainer) -> None:
        """After each step (callbacks and saves done) and at fit() start: close a captured step,
        poll the trigger file, start a requested capture."""
        now = time.perf_counter()
        if self.capturing and "t4" in self._t:
            self._t["t5"] = now
            self._open.__exit__(None, None, None)
            self.timers.append(self._t)
            self._t = {}
            self.remaining -= 1
            if self.remaining <= 0:
                self._guarded(self.finish, "finished")
        if now - self._last_poll >= self.poll_every_s:
            self._last_poll = now
            self._poll_trigger()
        if self._request is not None and not self.capturing and self.rt.is_master:
            if trainer._stop or trainer.step >= trainer.total_steps():
                return  # no step follows in this fit(): the request waits for the next one
            steps, out_dir = self._request
            self._request = None
            self._guarded(lambda: self._start(trainer.step, steps, out_dir), "started")

    def _guarded(self, fn, what: str) -> None:
        """A profile that cannot start or finish (another profiler session is running, a full disk)
        warns and is dropped: it never stops the training run."""
        try:
            fn()
        except Exception as e:
            self.capturing, self._t = False, {}
            warnings.warn(f"profile capture could not be {what}: {type(e).__name__}: {e}", stacklevel=3)

    def _start(self, step: int, steps: int, out_dir) -> None:
        root = Path(out_dir or self.out_dir or default_dir())
        self.folder = root / f"step{step:06d}-{time.strftime('%Y%m%d-%H%M%S')}"
        n = 1
        while self.folder.exists():
            n += 1
            self.folder = root / f"step{step:06d}-{time.strftime('%Y%m%d-%H%M%S')}-{n}"
        self.remaining, self.timers, self._t = steps, [], {}
        self.kind = self.rt.kind  # data, not a branch: steps.json names the backend the trace came from
        acts = self.rt.profiler_activities()  # torch.profiler's activities; none: torch_xla's own trace
        if not acts:
            import torch_xla.debug.profiler as xp

            self._torch_prof = None
            xp.start_trace(str(self.folder))
            self._span = lambda: _xla.trace_span(STEP_SPAN)
        else:
            import torch
            import torch.profiler as tp

            if torch.autograd.profiler._is_profiler_enabled:  # a second session crashes the process at exit
                raise RuntimeError("another torch.profiler session is running; stop it first")
            self._torch_prof = tp.profile(activities=acts)
            self._torch_prof.start()
            self._span = lambda: tp.record_function(STEP_SPAN)
        self.folder.mkdir(parents=True)  # after the session started: a refused start leaves no folder
        self.capturing = True

    def before_batch(self) -> None:
        if self._t:  # the last epoch's loader ran out after before_batch: close that span first
            self._open.__exit__(None, None, None)
        self._open = self._span()
        self._open.__enter__()
        self._t = {"t0": time.perf_counter()}

    def after_batch(self) -> None:
        self._t["t1"] = time.perf_counter()

    def before_sync(self) -> None:
        self._t["t2"] = time.perf_counter()

    def after_sync(self, step: int) -> None:
        """The step's graph is launched: wait for the device (captured steps only)."""
        t = self._t
        t["t3"] = time.perf_counter()
        self.rt.wait()  # the backend's: xm.wait_device_ops(), torch.cuda.synchronize(), or nothing
        t["t4"] = time.perf_counter()
        t["step"] = step

    def finish_quietly(self) -> list[Analysis]:
        """finish() at the end of fit(), returning what it added; a failure warns (it must not hide
        how fit() ended)."""
        n = len(self.results)
        try:
            self.finish()
        except Exception as e:
            warnings.warn(f"profile capture could not be finished: {type(e).__name__}: {e}", stacklevel=3)
        return self.results[n:]

    @staticmethod
    def describe(a: Analysis) -> str:
        """One line: where the capture went and how its steps split (data, host, device, ...)."""
        m = a.mean()
        total = max(m["total_s"], 1e-12)
        split = " ".join(f"{k[:-2]} {100 * v / total:.0f}%" for k, v in m.items() if k != "total_s")
        return f"profiled {len(a.steps)} steps -> {a.folder} ({split})"

    def finish(self) -> Analysis | None:
        """Stop the capture (also when fit() ends early), write the files, analyse them."""
        if not self.capturing:
            return None
        self.capturing = False
        if self._t:  # a step begun but not finished (loader ran out, an error): drop it
            self._open.__exit__(None, None, None)
            self._t = {}
        if self._torch_prof is None:  # torch_xla's own trace
            import torch_xla.debug.profiler as xp

            xp.stop_trace()
        else:
            self._torch_prof.stop()
            self._torch_prof.export_chrome_trace(str(self.folder / "trace.json"))
            self._torch_prof = None
        if not self.timers:
            warnings.warn(
                f"fit() ended before a profiled step finished: nothing to analyse in {self.folder}", stacklevel=3
            )
            return None
        (self.folder / "steps.json").write_text(json.dumps({"backend": self.kind, "steps": self.timers}, indent=1))
        a = analyze(self.folder)
        a.save_png(self.folder / "timeline.png")
        (self.folder / "summary.json").write_text(json.dumps(a.summary(), indent=1))
        self.results.append(a)
        return a


# -- reading traces ---------------------------------------------------------------------------------------
