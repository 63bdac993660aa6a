"""XLA health readings: host-only, shape-change descriptions, recompiles with unchanged shapes,
and labkit.dashboard.explain over a live process and over a saved metrics_report() text."""

import time

import pytest
import torch

import labkit
from labkit import _xla
from labkit.dashboard import health as xla_health
from labkit.dashboard.explain import explain, parse_report
from labkit.dashboard.health import HealthMonitor, describe_change, shape_signature


def _counts():
    import torch_xla.debug.metrics as met

    return tuple((met.metric_data(n) or (0,))[0] for n in ("ExecuteTime", "TransferFromDeviceTime", "CompileTime"))


def _settled_counts(timeout=10.0):
    """The counts once two reads 0.1 s apart agree. XLA records a graph's metrics on its own threads, so a
    count can still move after wait_device_ops() or .cpu() returned: seen on 2 busy cores, where this test
    once found ExecuteTime not yet incremented right after pending.cpu()."""
    last, deadline = _counts(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = _counts()
        if now == last:
            return now
        last = now
    return last


def test_reading_the_metrics_never_touches_the_device():
    import torch_xla
    import torch_xla.core.xla_model as xm

    rt = labkit.setup("xla-cpu")
    w = torch.randn(64, 64, device=rt.device)
    torch_xla.sync()
    xm.wait_device_ops()  # nothing in flight: every count below is final
    pending = (w @ w).sum()  # a graph waiting to run
    before = _settled_counts()
    mon = HealthMonitor(rt)
    mon.on_step(5, (pending, pending))
    info = mon.interval(steps=1)
    xla_health.snapshot(rt)
    explain(verbose=False)
    after = _counts()
    assert after == before, f"(executions, transfers, compiles) went {before} -> {after}"  # none of them may move
    assert info["xla"] and info["transfers"] == 0 and info["memory"] is None  # XLA:CPU has no allocator stats
    assert "aten::sum" in _xla.pending_graph_text([pending])  # still an unexecuted graph
    pending.cpu()
    deadline = time.monotonic() + 10  # its ExecuteTime sample may be recorded just after .cpu() returned
    while _counts()[0] <= before[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _settled_counts()[0] == before[0] + 1  # ... which a real read does execute


def test_shape_signature_and_change_descriptions():
    x, y = torch.zeros(32, 3, 8, 8), torch.zeros(32, dtype=torch.long)
    sig = shape_signature((x, y))
    assert sig == ((0, (32, 3, 8, 8), "float32"), (1, (32,), "int64"))
    assert describe_change(sig, shape_signature((x[:17], y[:17]))) == "batch shape changed (32→17)"
    seq = shape_signature({"ids": torch.zeros(8, 128, dtype=torch.long)})
    assert (
        describe_change(seq, shape_signature({"ids": torch.zeros(8, 96, dtype=torch.long)}))
        == "input 'ids' dim 1 changed (128→96)"
    )
    assert describe_change(sig, shape_signature((x.half(), y))) == "input 0 dtype changed (float32→float16)"
    assert (
        describe_change(sig, shape_signature((x[:, :1, :4, :4], y))) == "input 0 shape changed ([32,3,8,8]→[32,1,4,4])"
    )
    assert describe_change(sig, shape_signature(x)).startswith("batch structure changed")


def test_recompile_with_the_same_shapes_blames_the_graph():
    import torch_xla

    rt = labkit.setup("xla-cpu")
    batch = (torch.zeros(4, 5, device=rt.device),)
    mon = HealthMonitor(rt, warmup_steps=1)
    mon.on_step(1, batch)
    (torch.ones(7, 13, device=rt.device) * 3).sum()  # a graph never seen before: compiles
    torch_xla.sync()
    mon.on_step(2, batch)
    assert [e["step"] for e in mon.events] == [2]
    assert mon.events[0]["reason"] == xla_health.SAME_SHAPES_REASON
    mon.on_step(3, batch)  # nothing new compiled
    assert len(mon.events) == 1
    assert any(w.startswith("recompiled once after warm-up: graph changed") for w in mon.interval(3)["warnings"])


def test_explain_parses_a_saved_report_like_the_live_one():
    import torch_xla.debug.metrics as met

    rt = labkit.setup("xla-cpu")
    torch.nonzero(torch.arange(6, device=rt.device) > 2).cpu()  # one CPU fallback at least
    live = explain(verbose=False)
    saved = explain(met.metrics_report(), verbose=False)
    for k in ("compiles", "executions", "transfers", "fallbacks"):
        assert saved[k] == live[k], k
    for k in ("compile_s", "execute_s"):
        assert abs(saved[k] - live[k]) <= 0.01 * live[k] + 1e-3, (k, saved[k], live[k])
    assert saved["fallbacks"]["aten::nonzero"] >= 1 and "aten::nonzero" in saved["text"]
    p = parse_report(
        "Metric: CompileTime\n  TotalSamples: 3\n  Accumulator: 01m02s500ms\nCounter: aten::foo\n  Value: 7\n"
    )
    assert p == {"counters": {"aten::foo": 7}, "metrics": {"CompileTime": (3, 62.5)}}


def test_report_durations_undo_the_reports_rounding():
    from labkit.dashboard.explain import parse_duration

    # torch_xla printed 132,737,647 ns as "133ms737.647us" and 16.524 s as "17s524ms...": each unit but the
    # last is rounded to the nearest
    assert parse_duration("133ms737.647us") == pytest.approx(0.132737647)
    assert parse_duration("17s524ms188.877us") == pytest.approx(16.524188877)
    assert parse_duration("01m16s424ms") == pytest.approx(76.424)
    assert parse_duration("02m40s") == pytest.approx(100.0)
    assert parse_duration("512.25us") == pytest.approx(512.25e-6)
