"""Steering a running fit(): three buttons under the notebook dashboard, and their console twin.

    Dashboard(controls=True)      # the default: the notebook view shows the buttons, a script prints how-to

  Profile next N steps    trainer.request_profile(N)          (labkit.profiling; also SIGUSR1 / trigger file)
  Stop after this epoch   trainer.request_stop(after_epoch=True)
  Save a checkpoint now   trainer.request_checkpoint()        (needs the Trainer's CheckpointManager)

A click only sets a request; the Trainer acts on it at the next step boundary (stop: at the epoch's end),
so the buttons add nothing to a step: no widget is touched while training runs, unless clicked.

When a click arrives (measured with ipykernel 7.4 and ipywidgets 8.1; a kernel handles widget messages
on its shell channel): while a cell runs plain Python, such as `trainer.fit()`, the kernel reads no
message, so a click waits until the cell ends, which is too late: the label then says that no fit()
is running and the click is dropped (each fit() starts with no request pending). While a cell *awaits*,
ipykernel 7 dispatches widget messages at once: run the fit in a thread,

    history = await asyncio.to_thread(trainer.fit)      # a click reaches the Trainer at once

and the click reached the handler within milliseconds in that measurement (tests/test_dashboard_controls.py
stops a fit that way in a real kernel). ipykernel 6 (Colab's: 6.17.1) handles shell
messages one at a time, so there a click waits for the cell even while it awaits (measured in a browser,
tests/test_browser.py). One line works on both:

    history = await labkit.dashboard.fit_with_buttons(trainer)

It runs the fit in a thread; on ipykernel 6 it also hands the widget messages that wait in the kernel's
queue to the kernel every 50 ms (only those: the next cells' execute requests stay queued, in order),
leaving the running cell as the kernel's parent message, so the cell's output stays where it belongs.
Interrupting the kernel stops the fit after its current step, as it stops `trainer.fit()`.

Only APIs that ipywidgets 7.7.1 (Colab) and 8.x share are used: Button(description=, tooltip=), on_click,
IntText(value=, description=), Label(value=), HBox, Layout(width="auto"); nothing from `style`. Without ipywidgets (or
without a front end) there are no buttons and the run goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import threading

from labkit.envsetup import shell_words

PROFILE_SIGNAL = "SIGUSR1"  # what labkit.profiling listens to during fit()
PROFILE_TRIGGER = os.path.join("profiles", "PROFILE")  # its trigger file when labkit.profiling is absent
PROFILE_STEPS = 5
FIT_LINE = "history = await labkit.dashboard.fit_with_buttons(trainer)"  # the cell whose clicks act mid-run


def profile_trigger() -> str:
    """The trigger file that starts a capture (labkit.profiling's own answer when it is there)."""
    try:
        from labkit.profiling import trigger_path
    except ImportError:
        return os.environ.get("LABKIT_PROFILE_TRIGGER") or PROFILE_TRIGGER
    return str(trigger_path())


def script_help(pid: int | None = None) -> list[str]:
    """What the console twin prints once at train begin: the same three controls for a script."""
    pid = os.getpid() if pid is None else pid
    return [
        "controls: profile the next N steps: trainer.request_profile(N) from a callback, "
        f"or `kill -{PROFILE_SIGNAL.removeprefix('SIG')} {pid}` / `{shell_words('touch', profile_trigger())}` from a shell",
        "          stop after this epoch: trainer.request_stop(after_epoch=True); "
        "save a checkpoint now: trainer.request_checkpoint()",
    ]


class Controls:
    """The buttons of one Dashboard. `bind(trainer)` points them at the running Trainer (each fit()).
    `.buttons` maps a name ('profile', 'stop', 'save') to its Button; `.status` says what was asked."""

    def __init__(self, profile_steps: int = PROFILE_STEPS):
        self.trainer, self.running = None, False
        self.box = self.buttons = self.steps = self.status = None
        self._profile_steps = profile_steps

    def bind(self, trainer) -> None:
        """A fit() of `trainer` begins: clicks go to it. A fit in the kernel's main thread (a plain
        `trainer.fit()` in a cell) gets no click before the cell ends, and the label says so from the start."""
        self.trainer, self.running = trainer, True
        if threading.current_thread() is threading.main_thread():
            self._say(f"a click waits for this cell to end; to steer the run mid-way: {FIT_LINE}")
        else:
            self._say("")

    def unbind(self) -> None:
        """That fit() ended: a click now would be dropped by the next fit(), so it is refused (and said)."""
        self.running = False

    def widget(self):
        """The row of widgets (built once), or None when ipywidgets cannot be imported or built."""
        if self.box is not None:
            return self.box
        try:
            return self._build()
        except Exception:  # not installed, broken, or no kernel to talk to: no buttons, the run goes on
            self.box = self.buttons = self.steps = self.status = None
            return None

    def _build(self):
        import ipywidgets as w

        self.steps = w.IntText(value=self._profile_steps, description="steps")
        mid_run = "acts mid-run when the cell runs `await fit_with_buttons(trainer)`"
        wide = {"width": "auto"}  # the default width cuts "Stop after this epoch" to "Stop after this ep..."
        self.buttons = {
            "profile": w.Button(description="Profile next N steps", tooltip=f"trainer.request_profile(N); {mid_run}"),
            "stop": w.Button(description="Stop after this epoch", tooltip=f"trainer.request_stop(); {mid_run}"),
            "save": w.Button(description="Save a checkpoint now", tooltip=f"trainer.request_checkpoint(); {mid_run}"),
        }
        for b in self.buttons.values():
            b.layout = w.Layout(**wide)
        self.buttons["profile"].on_click(lambda _b: self._act("profile"))
        self.buttons["stop"].on_click(lambda _b: self._act("stop"))
        self.buttons["save"].on_click(lambda _b: self._act("save"))
        self.status = w.Label(value="")
        b = self.buttons
        self.box = w.HBox([b["profile"], self.steps, b["stop"], b["save"], self.status])
        return self.box

    def _act(self, what: str) -> None:
        """A click: ask the bound trainer; the status label says what happened (a handler must not raise:
        the front end would only show the traceback in the kernel's log)."""
        tr = self.trainer
        if tr is None or not self.running:
            return self._say(
                "no fit() is running (a click made while a cell runs `trainer.fit()`, or awaits it in a thread on "
                "ipykernel 6, arrives after it: run `await fit_with_buttons(trainer)`)"
            )
        try:
            if what == "profile":
                n = int(self.steps.value)
                if not hasattr(tr, "request_profile"):
                    return self._say("this Trainer cannot profile (no request_profile)")
                tr.request_profile(n)
                self._say(f"profiling the next {n} steps (from step {tr.step})")
            elif what == "stop":
                tr.request_stop(after_epoch=True)
                self._say(f"stopping after epoch {tr.epoch}")
            else:
                if getattr(tr, "checkpoint", None) is None:
                    return self._say("no CheckpointManager: nothing to save to")
                tr.request_checkpoint()
                self._say(f"saving after step {tr.step}")
        except Exception as e:
            self._say(f"{what} failed: {type(e).__name__}: {e}")

    def _say(self, text: str) -> None:
        if self.status is not None:
            self.status.value = text


WIDGET_MESSAGES = ("comm_open", "comm_msg", "comm_close", "comm_info_request")


async def fit_with_buttons(trainer, poll_s: float = 0.05):
    """`await` this in a notebook cell instead of calling trainer.fit(): the fit runs in a thread and the
    kernel handles the buttons' clicks while it runs (ipykernel 7 by itself; ipykernel 6 through
    serve_widget_messages). Returns what fit() returns; its exception, if it raises.

    Interrupting the kernel (the stop button, Ctrl-C) cancels the await, not the thread: the trainer is
    asked to stop after the step it is in, the await waits for that, and the cell then ends cancelled, as
    `trainer.fit()` ends with KeyboardInterrupt, its position kept for a resume. Without that, the fit
    went on in the background, still training the model the next cells use (measured, ipykernel 6 and 7).
    SIGTERM does the same, then raises KeyboardInterrupt("SIGTERM ...") once the pending checkpoint is saved."""
    # SIGTERM (a preempted VM): its default action ends the process with the fit thread's upload in flight;
    # here it stops the fit after its step, the fit finishes its pending save, then Preempted is raised
    with _sigterm_stops(trainer) as preempted:
        fit = asyncio.ensure_future(asyncio.to_thread(trainer.fit))
        kernel = _kernel_with_queue()
        try:
            while not fit.done():
                await asyncio.wait({fit}, timeout=poll_s)
                if kernel is not None:
                    await serve_widget_messages(kernel)
        except asyncio.CancelledError:
            trainer.request_stop()
            print(
                f"[labkit] interrupted at step {trainer.step}: the fit stops after this step "
                "(interrupt again to not wait)"
            )
            await asyncio.wait({fit})
            if (e := fit.exception()) is not None:
                print(f"[labkit] the fit ended with {type(e).__name__}: {e}")
            print(f"[labkit] the fit stopped at step {trainer.step}")
            raise
    result = fit.result()  # the fit's own error first
    if preempted:
        raise preempted[0]
    return result


@contextlib.contextmanager
def _sigterm_stops(trainer):
    """SIGTERM asks the trainer to stop after its current step (the fit thread then finishes its pending
    save as it ends); yields a list that holds the interrupt to raise once the fit has returned. Main thread
    only. A KeyboardInterrupt, as fit() turns SIGTERM into one (labkit.interrupts.Preempted, a layer above
    the dashboard), so `except Exception` does not swallow it."""
    got: list = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def handler(signum, frame):
        got.append(KeyboardInterrupt(f"SIGTERM (signal {signum}) during training"))
        trainer.request_stop()  # a flag: the fit thread stops at its next step boundary
        print(f"[labkit] SIGTERM at step {trainer.step}: stopping after this step, finishing the pending save")

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):  # not allowed here (embedded interpreters): leave it alone
        yield got
        return
    try:
        yield got
    finally:
        signal.signal(signal.SIGTERM, old)


def _kernel_with_queue():
    """The running ipykernel when it queues shell messages in `msg_queue` (ipykernel 6), else None."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    ip = get_ipython()
    kernel = getattr(ip, "kernel", None)
    if kernel is None or not hasattr(kernel, "msg_queue") or not hasattr(kernel, "shell_stream"):
        return None
    import ipykernel

    return kernel if int(ipykernel.__version__.split(".")[0]) < 7 else None


async def serve_widget_messages(kernel) -> int:
    """ipykernel 6: handle the widget messages (clicks) waiting in the kernel's shell queue while a cell
    runs; everything else (the next cells' execute requests) goes back to the queue, in order. Returns the
    number of messages handled. Reads the kernel's own queue, so it is tied to ipykernel 6's layout
    (msg_queue items are (order, dispatch, (raw frames,))); ipykernel 7 needs none of it."""
    kernel.shell_stream.flush()  # move what zmq has received into msg_queue
    waiting = []
    while True:
        try:
            waiting.append(kernel.msg_queue.get_nowait())
        except Exception:  # asyncio.QueueEmpty (or queue.Empty): nothing more
            break
    widget, other = [], []
    for item in waiting:
        (widget if _msg_type(kernel, item) in WIDGET_MESSAGES else other).append(item)
    for item in other:  # back before any await: nothing can slip in between
        kernel.msg_queue.put_nowait(item)
    for _order, _dispatch, args in widget:
        await _handle(kernel, args[0])
    if widget:
        kernel._publish_status("busy", "shell")  # the cell is still running
    return len(widget)


async def _handle(kernel, frames) -> None:
    """One widget message, handled as ipykernel 6's dispatch_shell handles it but for one thing: the kernel's
    parent message stays the running cell's. dispatch_shell makes the message the parent while it handles
    it, and whatever the fit thread prints or displays in that moment is sent as a reply to that message,
    which the front end drops (measured: the buttons' own row, displayed as the fit starts, went missing
    when the front end's comm_info_request came in at the same moment)."""
    idents, msg = kernel.session.feed_identities(list(frames), copy=False)
    msg = kernel.session.deserialize(msg, content=True, copy=False)
    kernel._publish_status("busy", "shell", parent=msg)
    try:
        result = kernel.shell_handlers[msg["header"]["msg_type"]](kernel.shell_stream, idents, msg)
        if inspect.isawaitable(result):
            await result
    except Exception:  # as dispatch_shell does: the kernel's log, and the cell goes on
        kernel.log.error("Exception in widget message handler", exc_info=True)
    finally:
        kernel._publish_status("idle", "shell", parent=msg)


def _msg_type(kernel, item) -> str | None:
    """The msg_type of a queued raw shell message, read from its header frame (nothing is consumed)."""
    try:
        args = item[2]
        _idents, frames = kernel.session.feed_identities(list(args[0]), copy=False)
        header = frames[1]
        return json.loads(getattr(header, "bytes", header))["msg_type"]
    except Exception:
        return None
