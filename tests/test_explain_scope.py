"""labkit.explain(dash) and the dashboard speak about the run the Dashboard watched: graphs that other code
compiled in the same process (an exercise check, a demo cell) before, between or after its fits are not the
run's, and a clean run gets no advice. The fits run on a fake clock that stands still: the feed meter's verdict,
which a loaded machine could add to the advice, is then "no wait" on any machine."""

import io

import torch

import labkit
from labkit import Dashboard
from labkit.dashboard import ConsoleSink
from tests.helpers import FakeClock
from tests.test_dashboard import _run


def _other_graphs(rt, n, first=0):
    """n graphs of other shapes, compiled and run outside any fit (what a notebook's other cells do)."""
    import torch_xla

    for k in range(first, first + n):  # shapes not compiled before: XLA's cache would not count them again
        (torch.ones(3 + k, 5 + k, device=rt.device) * (k + 1)).sum().cpu()
    torch_xla.sync()


def test_explain_counts_the_watched_run_only():
    rt = labkit.setup("xla-cpu")
    _other_graphs(rt, 25)  # > rules.MANY_COMPILES: the process's counts alone would earn advice
    dash = Dashboard(title="scope", sink=ConsoleSink(io.StringIO()))
    _run(rt, dim=29, steps=12, log_every=4, callbacks=[dash], clock=FakeClock())
    _other_graphs(rt, 4, first=25)  # after the fit: not the run's either
    info = labkit.explain(dash, verbose=False)
    assert info["scope"] == "run"
    # a fixed-shape SGD run: the step's graph (its first step differs once) and nothing else; at most a few
    assert 1 <= info["compiles"] <= 4, info
    assert info["executions"] < 25, info
    assert info["advice"] == [], info["advice"]
    assert "the run the dashboard watched" in info["text"] and "Nothing to fix" in info["text"]
    assert dash.history[-1]["xla_graphs_total"] <= info["compiles"]  # the panel's "graphs in all": the run's too
    # a second fit on the same Dashboard: what ran between the two fits stays out
    before = info["compiles"]
    _other_graphs(rt, 6, first=29)
    _run(rt, dim=29, steps=8, log_every=4, callbacks=[dash], clock=FakeClock())
    again = labkit.explain(dash, verbose=False)
    assert before <= again["compiles"] <= before + 2, (before, again["compiles"])
    # without a Dashboard, explain reads the whole process and says so
    whole = labkit.explain(verbose=False, rt=rt)
    assert whole["scope"] == "process" and whole["compiles"] >= 25 + 4 + 6
