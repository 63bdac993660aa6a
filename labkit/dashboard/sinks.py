"""Where the dashboard draws: a figure updated in place in a notebook, or one line per interval
in a console (fastprogress's twins). The environment is detected once per process;
force_console() or LABKIT_CONSOLE=1 choose the console twin anywhere.

    from labkit.dashboard import force_console
    force_console()   # lines instead of a figure, even in a notebook
"""

from __future__ import annotations

import os
import sys
import time
from typing import Protocol

from labkit.config import parse_bool
from labkit.dashboard.controls import Controls, script_help
from labkit.dashboard.view import html_header, summary_line


class Dashboard(Protocol):
    """What a sink reads from the dashboard it draws for (labkit.dashboard.collector.Dashboard is one): named
    here so that sinks need not import the collector, which imports them."""

    title: str
    controls: bool
    every: float | None

    def png_bytes(self) -> bytes: ...


_forced: str | None = None
_detected: str | None = None


def force_console(on: bool = True) -> None:
    """Use the console twin even inside a notebook (or undo with on=False)."""
    global _forced
    _forced = "console" if on else None


def environment() -> str:
    """'console', 'colab' or 'notebook' (detected once per process; see force_console)."""
    global _detected
    if _forced:
        return _forced
    if parse_bool(os.environ.get("LABKIT_CONSOLE", ""), "LABKIT_CONSOLE"):
        return "console"
    if _detected is None:
        _detected = "console"
        if "IPython" in sys.modules:
            from IPython import get_ipython

            ip = get_ipython()
            if ip is not None and getattr(ip, "kernel", None) is not None:
                _detected = "colab" if "google.colab" in sys.modules else "notebook"
    return _detected


class ConsoleSink:
    """Prints one line per interval and each warning when it first appears or changes."""

    min_interval_s = 0.0

    def __init__(self, stream=None):
        self.stream = stream
        self._helped = False

    def begin(self, trainer, dash: Dashboard) -> None:
        """Once per sink: how to do what the notebook's buttons do, from a script."""
        if dash.controls and not self._helped:
            self._helped = True
            for line in script_help():
                print(f"[{dash.title}] {line}", file=self.stream or sys.stdout, flush=True)

    def draw(self, frame: dict, dash: Dashboard) -> None:
        out = self.stream or sys.stdout
        print(summary_line(frame), file=out, flush=True)
        for w in frame["new_warnings"]:
            print(f"  ! {w}", file=out, flush=True)

    def draw_eval(self, metrics: dict, dash: Dashboard) -> None:
        vals = "  ".join(
            f"{k} {v:.4f}" for k, v in metrics.items() if k not in ("step", "epoch") and isinstance(v, float)
        )
        print(
            f"[{dash.title}] eval at step {metrics['step']} (epoch {metrics['epoch']}): {vals}",
            file=self.stream or sys.stdout,
            flush=True,
        )


class NotebookSink:
    """HTML header + PNG figure, each through one display handle updated in place (no stacking,
    no flicker; nbclient/nbval keep the last image in the saved output).

    The header (progress, numbers, warnings) costs well under a millisecond and is updated at most
    every `min_interval_s`. Rendering the figure costs ~0.15-0.25 s of host time (matplotlib Agg on
    one core at 72 dpi), which the training loop waits for: it is redrawn at most every `figure_every_s`
    (15 s: ~1 % of the time) and at the end; Dashboard(every=...) sets both."""

    min_interval_s = 1.0

    def __init__(self, figure_every_s: float = 15.0):
        self.figure_every_s = figure_every_s
        self._html = self._img = None
        self._img_t = 0.0
        self.controls: Controls | None = None

    def begin(self, trainer, dash: Dashboard) -> None:
        """The buttons (labkit.dashboard.controls), shown once above the figure and pointed at this fit's
        trainer. No ipywidgets or no front end: no buttons, nothing fails."""
        if not dash.controls:
            return
        if self.controls is None:
            self.controls = Controls()
            box = self.controls.widget()
            if box is not None:
                from IPython.display import display

                display(box)
        self.controls.bind(trainer)

    def end(self, trainer, dash: Dashboard) -> None:
        if self.controls is not None:
            self.controls.unbind()

    def draw(self, frame: dict, dash: Dashboard) -> None:
        from IPython.display import HTML, Image, display

        html = HTML(html_header(frame))
        every = dash.every if dash.every is not None else self.figure_every_s
        now = time.perf_counter()
        img = None
        if self._img is None or frame["final"] or now - self._img_t >= every:
            img, self._img_t = Image(data=dash.png_bytes()), now
        if self._img is None:
            self._html = display(html, display_id=True)
            self._img = display(img, display_id=True)
        else:
            self._html.update(html)
            if img is not None:
                self._img.update(img)
