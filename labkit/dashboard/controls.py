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
stops a fit that way in a real kernel). Older kernels (ipykernel 6, as Colab's has been; not measured here)
handle shell messages one at a time, so a click waits for the cell even then; what works mid-run there
is a callback calling the same methods, or for profiling the signal / trigger file that the console
twin prints. In a thread, Ctrl-C / "interrupt" stops the await but not the fit: use "Stop after this epoch",
or call trainer.request_stop(). labkit does not poll the kernel from inside a cell (jupyter-ui-poll's
way): with ipykernel 7 there is no do_one_iteration() to call, and re-entering the kernel's event loop
from the cell it is running is not safe.

Only APIs that ipywidgets 7.7.1 (Colab) and 8.x share are used: Button(description=), on_click, IntText
(value=, description=), Label(value=), HBox; nothing from `layout`/`style`. Without ipywidgets (or
without a front end) there are no buttons and the run goes on.
"""

from __future__ import annotations

import os

PROFILE_SIGNAL = "SIGUSR1"  # what labkit.profiling listens to during fit()
PROFILE_TRIGGER = os.path.join("profiles", "PROFILE")  # its trigger file when labkit.profiling is absent
PROFILE_STEPS = 5


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
        f"or `kill -{PROFILE_SIGNAL.removeprefix('SIG')} {pid}` / `touch {profile_trigger()}` from a shell",
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
        """A fit() of `trainer` begins: clicks go to it."""
        self.trainer, self.running = trainer, True

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
        self.buttons = {
            "profile": w.Button(description="Profile next N steps"),
            "stop": w.Button(description="Stop after this epoch"),
            "save": w.Button(description="Save a checkpoint now"),
        }
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
                "no fit() is running (a click made during a plain `trainer.fit()` cell arrives after it: "
                "run `await asyncio.to_thread(trainer.fit)`)"
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
