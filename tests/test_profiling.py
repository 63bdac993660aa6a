"""Profiling a live fit() on XLA:CPU and CPU: requested from a callback, a trigger file and a signal;
the traces are real (torch_xla's profiler session, torch.profiler) and the analysis reads them back."""

import json
import os
import signal
import subprocess
import time
from importlib import metadata

import pytest
import torch
import torch.nn as nn

import labkit
from labkit import TrainConfig, Trainer
from labkit.profiling import CATEGORIES, analyze, trace_files, viewers
from labkit.profiling.analysis import rank_ops
from tests.helpers import blobs, mlp


def conv_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 4))


def images(n=128):
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


class SlowLoader:
    """A DataLoader that sleeps before each batch: the data wait the analysis must find."""

    def __init__(self, loader, sleep_s):
        self.loader, self.sleep_s = loader, sleep_s

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for b in self.loader:
            time.sleep(self.sleep_s)
            yield b


class At:
    """Runs fn(trainer) once, at the end of the given step."""

    def __init__(self, step, fn):
        self.step, self.fn, self.seen = step, fn, []

    def on_step_end(self, trainer, batch):
        if trainer.step == self.step:
            self.fn(trainer)

    def on_profile(self, trainer, analysis):
        self.seen.append(analysis)


def fit(kind, model, data, callbacks=(), steps=8, batch=16, sleep_s=None):
    rt = labkit.setup(kind)
    loader = torch.utils.data.DataLoader(data, batch_size=batch)
    if sleep_s is not None:  # a slow loader, and a short prefetch queue so that the wait is not hidden
        loader = labkit.DeviceLoader(SlowLoader(loader, sleep_s), rt, device_prefetch=1, loader_prefetch=1)
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), rt, TrainConfig(max_steps=steps, log_every=4),
                 loader, callbacks=list(callbacks))  # fmt: skip
    tr.fit()
    return tr


def check_split(a):
    for s in a.steps:
        parts = sum(s[c + "_s"] for c in CATEGORIES)
        assert all(s[c + "_s"] >= 0 for c in CATEGORIES), s
        assert abs(parts - s["total_s"]) < 1e-6 + 1e-3 * s["total_s"], s


@pytest.mark.parametrize("kind", ["xla-cpu", "cpu"])
def test_request_from_a_callback_captures_the_next_steps(kind, tmp_path):
    cb = At(2, lambda tr: tr.request_profile(3, out_dir=str(tmp_path)))
    tr = fit(kind, mlp(), blobs(), [cb])
    assert tr.step == 8 and len(tr.profiles) == 1 and cb.seen == tr.profiles
    a = tr.profiles[0]
    assert [s["step"] for s in a.steps] == [3, 4, 5]
    assert a.folder.parent == tmp_path and a.folder.name.startswith("step000002-")
    files = {p.name.split(".", 1)[-1] if kind == "xla-cpu" else p.name for p in trace_files(a.folder)}
    assert files == ({"xplane.pb", "trace.json.gz"} if kind == "xla-cpu" else {"trace.json"}), files
    assert a.has_op(), a.table()  # addmm / mm on CPU, dot on XLA
    assert a.has_op(r"^dot(\.\d+)?$" if kind == "xla-cpu" else r"aten::(addmm|mm)$")
    # ranked by instruction: each name of the trace once, with the sum of its executions
    names = {e["name"] for e in a.op_events}
    assert sorted(n for n, *_ in a.ops) == sorted(names)
    assert all(abs(t - sum(e["dur_us"] for e in a.op_events if e["name"] == n) / 1e6) < 1e-9 for n, t, _ in a.ops)
    if kind == "xla-cpu":
        assert all(e.get("module", "").startswith("SyncTensorsGraph") for e in a.op_events), a.op_events[:2]
        assert len([n for n in names if n.startswith("dot")]) >= 2, names  # dot, dot.N: instructions apart
    trace = json.loads(viewers.chrome_trace(a.folder).read_text())  # what ui.perfetto.dev opens
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert sum(e.get("name") == "labkit_step" for e in events) >= 3
    how = viewers.how_to_open(a.folder, colab=True)
    if kind == "xla-cpu":
        assert f"%tensorboard --logdir {a.folder.resolve()}" in how and "%load_ext tensorboard" in how, how
        pins = (a.folder / "keep-installed.txt").read_text()
        assert f"torch=={metadata.version('torch')}\n" in pins and "torch_xla==" in pins, pins
    assert "ui.perfetto.dev" in how and str(a.folder.resolve() / "trace.json") in how, how
    check_split(a)
    assert all(s["device_s"] > 0 for s in a.steps), a.table()
    assert a.mean()["host_s"] > 0
    png = (a.folder / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    summary = json.loads((a.folder / "summary.json").read_text())
    assert summary["backend"] == kind and len(summary["steps"]) == 3 and summary["top_ops"]
    again = analyze(a.folder)  # read back from disk alone
    assert again.steps == a.steps and again.ops == a.ops
    out = tmp_path / "t.png"
    a.save_png(out)
    assert out.stat().st_size > 5000 and "data_wait" in a.table()


@pytest.mark.parametrize("kind", ["xla-cpu", "cpu"])
def test_trigger_file_touched_by_another_process_profiles_a_conv_net(kind, tmp_path, monkeypatch):
    trigger = tmp_path / "go"
    monkeypatch.setenv("LABKIT_PROFILE_TRIGGER", str(trigger))
    monkeypatch.setenv("LABKIT_PROFILE_DIR", str(tmp_path / "profiles"))

    def touch(tr):
        tr.profiler.poll_every_s = 0.0  # poll every step: this run is shorter than the default second
        subprocess.run(["sh", "-c", f"echo 2 > {trigger}"], check=True)

    tr = fit(kind, conv_net(), images(), [At(1, touch)])
    assert not trigger.exists(), "the trigger file is removed when seen"
    (a,) = tr.profiles
    assert len(a.steps) == 2 and a.folder.parent == tmp_path / "profiles"
    assert a.has_op(r"conv"), a.table()  # convolution (HLO) / aten::convolution
    check_split(a)


@pytest.mark.parametrize("kind", ["xla-cpu", "cpu"])
def test_data_wait_is_found_when_the_loader_is_slow(kind, tmp_path):
    waits = {}
    for sleep_s in (None, 0.15):  # the plain loader (default prefetch), then one sleeping 0.15 s a batch
        cb = At(3, lambda tr: tr.request_profile(2, out_dir=str(tmp_path)))
        tr = fit(kind, mlp(), blobs(n=96), [cb], steps=6, sleep_s=sleep_s)
        (a,) = tr.profiles
        check_split(a)
        waits[sleep_s] = a.mean()["data_wait_s"]
    # the sleep, minus its overlap with a step of a few ms, is waited for in each step; the plain loader's
    # batches are ready (on XLA already in the prefetch queue)
    assert waits[0.15] > 0.05 and waits[0.15] > waits[None] + 0.04, waits


def test_no_request_no_capture(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE_DIR", str(tmp_path))
    tr = fit("cpu", mlp(), blobs(), steps=4)
    assert tr.profiles == [] and list(tmp_path.iterdir()) == []
    assert not tr.profiler.capturing


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_sigusr1_requests_a_capture_and_the_handler_is_restored(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROFILE_DIR", str(tmp_path))
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    tr = fit("cpu", mlp(), blobs(), [At(2, lambda tr: os.kill(os.getpid(), signal.SIGUSR1))], steps=10)
    (a,) = tr.profiles
    assert [s["step"] for s in a.steps] == [3, 4, 5, 6, 7]  # the default: 5 steps
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_a_capture_cut_short_by_the_end_of_fit_keeps_its_steps(tmp_path):
    tr = fit("cpu", mlp(), blobs(), [At(2, lambda tr: tr.request_profile(50, out_dir=str(tmp_path)))], steps=5)
    (a,) = tr.profiles
    assert [s["step"] for s in a.steps] == [3, 4, 5] and (a.folder / "summary.json").exists()
    last = fit("cpu", mlp(), blobs(), [At(5, lambda tr: tr.request_profile(2, out_dir=str(tmp_path / "l")))], steps=5)
    assert last.profiles == [] and not (tmp_path / "l").exists()  # asked at the last step: kept for a next fit()
    assert last.profiler._request is not None


def test_bad_requests_name_the_culprit(tmp_path, monkeypatch):
    rt = labkit.setup("cpu")
    tr = Trainer(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1), rt)
    for bad in (0, -1, 2.5, "3", True):
        with pytest.raises(ValueError, match="steps"):
            tr.request_profile(bad)
    trigger = tmp_path / "PROFILE"
    trigger.write_text("lots")
    monkeypatch.setenv("LABKIT_PROFILE_TRIGGER", str(trigger))
    with pytest.warns(UserWarning, match="PROFILE"):
        tr.profiler.step_boundary(tr)
    with pytest.raises(FileNotFoundError, match="steps.json"):
        analyze(tmp_path)


def test_a_capture_that_cannot_start_warns_and_training_goes_on(tmp_path):
    import torch.profiler as tp

    with tp.profile(activities=[tp.ProfilerActivity.CPU]):  # the user's own session, already running
        with pytest.warns(UserWarning, match="another torch.profiler session"):
            tr = fit("cpu", mlp(), blobs(), [At(1, lambda tr: tr.request_profile(2, out_dir=str(tmp_path)))], steps=4)
    assert tr.step == 4 and tr.profiles == [] and list(tmp_path.iterdir()) == []


@pytest.mark.timing
def test_a_capture_from_the_first_xla_step_shows_the_compile(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4))  # a graph no other test compiled
    rt = labkit.setup("xla-cpu")
    tr = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), rt, TrainConfig(max_steps=3, log_every=3),
                 torch.utils.data.DataLoader(blobs(n=64), batch_size=16))  # fmt: skip
    tr.request_profile(3, out_dir=str(tmp_path))  # before fit(): starts with the first step
    tr.fit()
    (a,) = tr.profiles
    first, *rest = a.steps
    assert first["step"] == 1 and first["compile_s"] > 0 and all(s["compile_s"] == 0 for s in rest), a.table()
    assert first["compile_s"] > 10 * first["device_s"]  # compiling takes far longer than running this graph


def test_timeline_shows_every_captured_step_and_labels_a_compiling_one(tmp_path):
    from labkit.profiling import Analysis

    zero = {f"{c}_s": 0.0 for c in CATEGORIES}
    steps = [
        {"step": 4, "total_s": 0.7, **zero, "compile_s": 0.65, "device_s": 0.05},
        *({"step": n, "total_s": 0.05, **zero, "device_s": 0.05} for n in (5, 6, 7)),
    ]
    edges = [0.0, 0.7, 0.75, 0.8, 0.85]
    a = Analysis(tmp_path, "xla-cpu", steps, {"compile": [(0.0, 0.65)], "device": [(0.65, 0.85)]}, edges)
    ax = a.timeline().axes[0]
    assert ax.get_title() == "xla-cpu: all 4 profiled steps"
    labels = [t.get_text() for t in ax.texts]
    assert labels[0] == "step 4: 700 ms\n(650 ms compiling)" and labels[1:] == [f"step {n}: 50 ms" for n in (5, 6, 7)]
    assert a.timeline(2).axes[0].get_title() == "xla-cpu: 2 of 4 profiled steps"


# two instructions of XLA:CPU's optimized HLO for an MLP step (torch_xla 2.9): a fusion calling its own computation
HLO = """HloModule SyncTensorsGraph.199, entry_computation_layout={()->()}

%fused_computation.12 (param_0.25: f32[32,128], param_1.51: f32[128]) -> f32[32,128] {
  %param_0.25 = f32[32,128]{1,0} parameter(0)
  %param_1.51 = f32[128]{0} parameter(1)
  %broadcast.71 = f32[32,128]{1,0} broadcast(%param_1.51), dimensions={1}
  %add.13 = f32[32,128]{1,0} add(%param_0.25, %broadcast.71)
  %constant.25 = f32[] constant(0.707106769)
  %broadcast.69 = f32[32,128]{1,0} broadcast(%constant.25), dimensions={}
  %multiply.20 = f32[32,128]{1,0} multiply(%add.13, %broadcast.69)
  ROOT %erf.0 = f32[32,128]{1,0} erf(%multiply.20)
}

%fused_computation.3 (param_0.3: f32[128,64], param_1.9: f32[128,64], param_2.9: f32[]) -> f32[128,64] {
  %param_0.3 = f32[128,64]{1,0} parameter(0)
  %param_1.9 = f32[128,64]{1,0} parameter(1)
  %param_2.9 = f32[] parameter(2)
  %broadcast.14 = f32[128,64]{1,0} broadcast(%param_2.9), dimensions={}
  %multiply.3 = f32[128,64]{1,0} multiply(%param_1.9, %broadcast.14)
  ROOT %add.3 = f32[128,64]{1,0} add(%param_0.3, %multiply.3)
}

ENTRY %SyncTensorsGraph.199 (p3.5: f32[128], p4.6: f32[128,64]) -> (f32[32,128]) {
  %dot.9 = f32[32,128]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %multiply_erf_fusion = f32[32,128]{1,0} fusion(%dot.9, %p3.5), kind=kLoop, calls=%fused_computation.12
  %multiply_add_fusion.3 = f32[128,64]{1,0} fusion(%p4.6, %dot, %p6.89), kind=kLoop, calls=%fused_computation.3
  ROOT %tuple = (f32[32,128]{1,0}) tuple(%multiply_erf_fusion)
}
"""


def test_ops_are_ranked_by_instruction_and_a_fusion_shows_what_it_fused(tmp_path):
    # fusion.3 and fusion.7 are two instructions: summed by kind "fusion" would lead (90 us), by instruction the
    # dot (60 us) does
    ev = [
        {"name": "fusion.3", "dur_us": 25.0},
        {"name": "fusion.7", "dur_us": 35.0},
        {"name": "fusion.3", "dur_us": 30.0},
    ]
    ev += [{"name": "dot.1", "dur_us": 60.0}]
    assert [(n, round(t * 1e6), c) for n, t, c in rank_ops(ev)] == [
        ("dot.1", 60, 1),
        ("fusion.3", 55, 2),
        ("fusion.7", 35, 1),
    ]
    assert rank_ops(ev, numbered=True)[0][0] == "fusion"
    (tmp_path / "module_0000.SyncTensorsGraph.199.cpu_after_optimizations.txt").write_text(HLO)
    at = {"module": "SyncTensorsGraph.199"}
    assert viewers.fused_ops(tmp_path, {"name": "multiply_erf_fusion", **at}) == ["add", "multiply", "erf"]
    assert viewers.fused_ops(tmp_path, {"name": "multiply_add_fusion.3", **at}, every=True) == [
        "broadcast", "multiply", "add"]  # fmt: skip
    assert viewers.fused_ops(tmp_path, {"name": "dot.9", **at}) == []  # not a fusion
    assert viewers.fused_ops(tmp_path, {"name": "dot.9", "module": "SyncTensorsGraph.7"}) is None  # not dumped
    assert viewers.fused_ops(tmp_path, {"name": "dot.9"}) is None
