"""torch.compile's record on the plain CPU (labkit.dashboard.dynamo): a planted graph break, planted recompiles (a
Python number that changes, a new shape) named with the failed guard and the line, compile time, torch's own
boundaries kept apart, and the same record read by the Dashboard's health panel and labkit.explain(); the CUDA
host-sync counter's counting (its CUDA half needs a GPU, which CI lacks).

Dynamo-level tests compile with backend="eager": guards, graph breaks and recompiles are Dynamo's, the same under
Inductor, which would add tens of seconds of C++ compilation per graph on these 2 cores without testing more."""

import importlib.util
import inspect
import io
import warnings

import pytest
import torch

import labkit
from labkit import Dashboard, TrainConfig, Trainer
from labkit.dashboard import ConsoleSink
from labkit.dashboard.dynamo import CompileRecord, break_text, guard_line, guard_source, parse_break, recompile_text
from labkit.dashboard.view import health_lines
from tests.helpers import blobs, mlp


@pytest.fixture(autouse=True, scope="module")
def _xla_first():
    # XLA's devices start before any backward in this process (labkit.device says why); where torch_xla is absent (the
    # torch 2.11 venv of tests/test_gpu_check.py, which runs this module too) there is nothing to start
    if importlib.util.find_spec("torch_xla") is not None:
        labkit.setup("xla-cpu")
    torch._dynamo.reset()  # the frames other modules compiled (an optimizer's step) are not this module's recompiles
    yield
    torch._dynamo.reset()


def _line_of(fn, text: str) -> int:
    """The file line number of the first line of fn's source that contains text."""
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, ln in enumerate(src) if text in ln)


def planted(x, s):
    y = x * s  # a Python float: Dynamo specialises the graph on its value (a guard)
    print("step")  # a graph break
    return y + 1


def test_planted_break_and_recompiles_are_named_with_their_lines(capsys):
    rec = CompileRecord()
    f = torch.compile(planted, backend="eager", dynamic=False)
    f(torch.ones(3), 2.0)
    assert rec.recompiles() == [] and rec.snapshot()["compiles"] >= 1
    f(torch.ones(3), 3.0)  # the number changed: a recompile
    f(torch.ones(4), 3.0)  # a new shape under dynamic=False: a recompile
    n = len(rec.events())
    f(torch.ones(4), 3.0)  # nothing new: no event
    assert len(rec.events()) == n
    here = __file__.rsplit("/", 1)[-1]

    brk = rec.breaks()
    assert len(brk) == 1 and brk[0]["reason"] == "Failed to trace builtin operator"
    assert brk[0]["site"] == f'{here}:{_line_of(planted, "print(")} print("step")  # a graph break'
    assert brk[0]["owner"] == "yours" and brk[0]["count"] == 3  # met by each of the three compiles of `planted`
    assert break_text(brk[0]).startswith(f"{here}:{_line_of(planted, 'print(')} print(")

    recs = [e for e in rec.recompiles() if e["frame"].startswith("planted ")]
    assert [e["guard"] for e in recs] == ["s == 2.0", "tensor 'x' size mismatch at index 0. expected 3, actual 4"]
    assert recs[0]["frame"] == f"planted ({here}:{_line_of(planted, 'def planted')})"
    assert recs[0]["guard_site"].startswith(f"{here}:{_line_of(planted, 'y = x * s')} y = x * s")
    call = _line_of(test_planted_break_and_recompiles_are_named_with_their_lines, "f(torch.ones(4), 3.0)  # a new")
    assert recs[1]["guard_site"] is None and recs[1]["call"].startswith(f"{here}:{call} ")
    assert recompile_text(recs[0]) == (
        f"planted ({here}:{_line_of(planted, 'def planted')}) recompiled: guard failed: s == 2.0 "
        f"(at {recs[0]['guard_site']})"
    )
    s = rec.snapshot()
    assert s["compile_s"] > 0 and s["breaks"] == 1 and s["torch_breaks"] == 0 and s["recompiles"] >= 2

    capsys.readouterr()
    info = labkit.explain(rt=labkit.setup("cpu"))
    out = capsys.readouterr().out
    assert info["xla"] is False and info["engine"] == "torch.compile" and "not running on XLA (cpu)" in out
    assert f"Graph break at {brk[0]['site']}: Failed to trace builtin operator." in out
    assert f"Recompile: {recompile_text(recs[0])}. Fix: a Python value" in out
    assert "size mismatch at index 0. expected 3, actual 4" in out and "mark_dynamic" in out
    rec.close()  # torch's logger goes back to no handler of labkit's


def test_explain_of_a_record_lists_each_recompile_once_and_reads_id_guards():
    torch._dynamo.reset()
    rec = CompileRecord()
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opts = [opt, torch.optim.SGD(model.parameters(), lr=0.1)]  # both kept alive: an id guard, not a freed object

    def step(o):
        o.step()

    f = torch.compile(step, backend="eager", dynamic=False)
    model(torch.ones(2, 3)).sum().backward()
    for o in opts:
        f(o)
    g = torch.compile(planted, backend="eager", dynamic=False)
    for s in (2.0, 3.0, 4.0):
        g(torch.ones(3), s)
    try:
        info = labkit.explain(rec, rt=labkit.setup("cpu"), verbose=False)
    finally:
        rec.close()
        torch._dynamo.reset()  # the optimizer's compiled step is not the next test's
    lines = info["text"].splitlines()
    smooth = [ln for ln in lines if "s == " in ln]
    assert (
        len(smooth) == 1
        and smooth[0].startswith("- Recompile (2 times): planted (")
        and "s == 2.0, then s == 3.0 (at " in smooth[0]
    )
    ids = [ln for ln in lines if "___check_obj_id" in ln]
    assert ids and all("an id guard" in ln and "a new optimizer" in ln for ln in ids), ids
    assert "keep it the same from step to step" not in info["text"]
    assert len(info["recompile_events"]) == info["recompiles"] == 2 + len(ids), info["text"]  # nothing from before


def test_torch_own_boundaries_are_not_blamed_on_the_code():
    rec = CompileRecord()
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, capturable=True)

    def whole_step(x):
        loss = model(x).square().mean()
        loss.backward()  # Dynamo does not trace it (compiled autograd off): torch's own boundary
        opt.step()  # _use_grad breaks around the update on purpose
        opt.zero_grad()  # skipped by Dynamo on purpose
        return loss

    step = torch.compile(whole_step, backend="eager", dynamic=False)
    step(torch.ones(2, 3))
    n = len(rec.events())
    step(torch.ones(2, 3))
    assert len(rec.events()) == n and rec.recompiles() == []  # warm: nothing compiles again
    assert rec.breaks() == [] and rec.breaks("labkit") == []
    own = rec.breaks("torch")
    whys = " | ".join(b["torch_boundary"] for b in own)
    assert len(own) == 3 and "loss.backward()" in whys and "_use_grad" in whys and "zero_grad" in whys
    assert any(
        b["site"].endswith("loss.backward()  # Dynamo does not trace it (compiled autograd off): torch's own boundary")
        for b in own
    )
    assert "0 graph breaks in your code, 3 of torch's own" in rec.report()

    # a break of the code's own, planted beside them, is still named as the code's
    def with_item(x):
        loss = model(x).mean()
        if loss.item() > 0:  # reads a value into Python: a graph break
            loss = loss * 2
        return loss

    torch.compile(with_item, backend="eager", dynamic=False)(torch.ones(2, 3))
    mine = rec.breaks()
    assert len(mine) == 1 and mine[0]["owner"] == "yours" and "loss.item()" in mine[0]["site"]
    rec.close()


def test_parse_break_reads_both_forms():
    b = parse_break('Graph break in user code at /a/b.py:7\nGraph Break Reason: Data-dependent branching\n'
                    '  Explanation: Detected data-dependent branching.\nUser code traceback:\n'
                    '  File "/a/b.py", line 7, in g\n    if x.sum() > 0:\n\n')  # fmt: skip
    assert (b["file"], b["line"], b["reason"]) == ("/a/b.py", 7, "Data-dependent branching")
    assert b["explanation"] == "Detected data-dependent branching." and b["user_frames"][-1][3] == "if x.sum() > 0:"
    w = parse_break("WON'T CONVERT f /a/c.py line 3\n===== TorchDynamo Stack Trace =====")
    assert (w["file"], w["line"], w["reason"]) == ("/a/c.py", 3, "could not compile f")
    assert parse_break("something else") is None
    # torch 2.11's form: what Dynamo was tracing, a blank line, then the break's type (the registry's, by the link)
    n = parse_break('Graph break in user code at /a/b.py:9\nGraph Break Reason: Encountered graph break when '
                    'attempting to trace CALL: a function call, e.g. f(x, y):\n\nFailed to trace builtin operator\n'
                    '  Explanation: Dynamo does not know how to trace builtin operator `print`\n\n For more details '
                    'about this graph break, please visit: https://x/gb/gb0059.html\n\nUser code traceback:\n'
                    '  File "/a/b.py", line 9, in g\n    print(y)\n\nTraceback (most recent call last):\n')  # fmt: skip
    assert (n["file"], n["line"], n["gb_id"]) == ("/a/b.py", 9, "GB0059")
    assert n["reason"] == "Failed to trace builtin operator" and n["explanation"].startswith("Dynamo does not know")
    assert n["user_frames"] == [("/a/b.py", 9, "g", "print(y)")]
    # and its failed guard, with a "User stack trace" below: the line is the trace's innermost frame, read whole
    g = 's == 2.0  # y = x * s  # why  # b.py:4 in f\nUser stack trace:\n  File "%s", line %d, in f\n    y = x * s  # why'
    line = _line_of(planted, "y = x * s")
    assert str(guard_source(g % (__file__, line), __file__)).endswith(
        f":{line} y = x * s  # a Python float: Dynamo specialises the graph on its value (a guard)"
    )
    # torch 2.11's id guard prints the object after it, over several lines: the guard is its first line
    idg = "___check_obj_id(self, 140325040022704), type=SGD (\nParameter Group 0\n    lr: 0.1\n)"
    assert guard_line(idg) == "___check_obj_id(self, 140325040022704), type=SGD"
    assert guard_line("lr == 0.1  # y = x * lr  # a.py:3 in f") == "lr == 0.1"  # torch 2.9's form


class PlantedStep(Trainer):
    """A learner's step that calls a compiled function with a Python number that changes after warm-up (step 5) and
    a print() inside (a graph break)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.scaled = torch.compile(scaled_loss, backend="eager", dynamic=False)

    def train_step(self, batch):
        x, y = batch
        loss = self.scaled(self.model(x), y, 1.0 if self.step < 4 else 0.5)
        self.backward(loss)
        return loss


def scaled_loss(out, y, scale):
    loss = torch.nn.functional.cross_entropy(out, y) * scale
    print("planted")  # the planted graph break
    return loss


def test_dashboard_and_explain_name_them_off_xla():
    rt = labkit.setup("cpu")
    ds = blobs(n=32 * 8, dim=8)
    model = mlp(dim=8)
    dash = Dashboard(title="compiled", sink=ConsoleSink(io.StringIO()))
    PlantedStep(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        rt,
        TrainConfig(epochs=1, log_every=4, eval_every=0),
        torch.utils.data.DataLoader(ds, batch_size=32),
        callbacks=[dash],
    ).fit()
    here = __file__.rsplit("/", 1)[-1]
    h = dash.frame()["health"]
    assert h["engine"] == "torch.compile" and h["xla"] is False and h["graphs_total"] >= 2
    assert h["recompiles"] == 1 and dash.health.events[0]["step"] == 5  # warm-up: the first 2 steps
    ev = dash.health.events[0]
    assert ev["guard"] == "scale == 1.0" and ev["site"].startswith(f"{here}:{_line_of(scaled_loss, '* scale')} ")
    site = f'{here}:{_line_of(scaled_loss, "print(")} print("planted")  # the planted graph break'
    assert f"graph break at {site}: Failed to trace builtin operator" in dash.frame()["warnings"]
    assert any(w.startswith(f"recompiled once after warm-up: guard failed in scaled_loss ({here}:") and
               "scale == 1.0 (compiled at " in w for w in dash.frame()["warnings"])  # fmt: skip
    lines = health_lines(dash.frame())
    assert lines[0].startswith("torch.compile: ") and "1 recompiles after warm-up" in lines[0]
    assert lines[1] == "graph breaks: yours: 1, labkit's: 0, torch's own: 0"
    assert any(ln.startswith("recompiled at step 5: ") for ln in lines) and f"graph break at {site}: " + (
        "Failed to trace builtin operator") in lines  # fmt: skip
    assert [r["dynamo_graphs_total"] > 0 for r in dash.history] == [True, True]
    info = labkit.explain(dash, verbose=False)
    assert "1 recompiles after warm-up, graph breaks: yours: 1, labkit's: 0, torch's own: 0" in info["text"]
    assert "scale == 1.0" in info["text"] and "pass it as a tensor" in info["text"]


def test_eager_cpu_run_shows_no_compile_panel():
    from labkit.dashboard.health import HealthMonitor

    mon = HealthMonitor(labkit.setup("cpu"))
    for step in range(1, 5):
        mon.on_step(step, torch.ones(2, 3))
    out = mon.interval(4)
    assert out["engine"] == "torch.compile" and out["compiles"] == 0 and out["recompiles"] == 0
    assert out["breaks"] == [] and out["warnings"] == [] and out["transfers"] is None
    assert health_lines({"health": out}) == []


def _sync_here(counter):
    warnings.warn(
        "called a synchronizing CUDA operation", UserWarning, stacklevel=1
    )  # torch's text, as sync debug mode raises it


def test_host_sync_counter_counts_torch_sync_warnings_per_line():
    from labkit.dashboard.cuda_syncs import HostSyncCounter, applies

    assert not applies(labkit.setup("cpu"))
    with warnings.catch_warnings(record=True) as shown:  # what would have been shown, kept in a list
        warnings.simplefilter("always")
        counter = HostSyncCounter().start()
        try:
            for _ in range(3):
                _sync_here(counter)
            warnings.warn("something else, shown as before", stacklevel=1)
        finally:
            counter.stop()
    got = counter.take()
    here = __file__.rsplit("/", 1)[-1]
    [(site, n)] = got.items()
    assert n == 3 and (site.file, site.line) == (__file__, _line_of(_sync_here, "warnings.warn"))
    assert str(site) == f"{here}:{site.line} warnings.warn("  # the line of the call (its first line)
    assert counter.take() == {} and sum(counter.total.values()) == 3
    assert [str(w.message) for w in shown] == ["something else, shown as before"]  # others are shown as before
