"""Hostile input, round 5: nothing blamed that is not proven, nothing left behind, nothing dropped or trusted without
a word. One compiled run on the plain CPU (fp16's GradScaler, clip_norm, accumulation, an LR scheduler that restarts
and one that writes a float) serves the checks of torch's own graph breaks, the tensor lr and the dropped samples;
the rest are cheap: real files, real processes, torch's own graph-break texts."""

from __future__ import annotations

import ast
import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import labkit
from labkit import Dashboard, TrainConfig, Trainer
from labkit.dashboard import ConsoleSink
from labkit.dashboard.dynamo import CompileRecord
from labkit.dashboard.view import health_lines
from labkit.precision import Precision
from labkit.runtime import boundaries
from tests.helpers import blobs, mlp

ROOT = Path(__file__).resolve().parent.parent
TORCH_DIR = os.path.dirname(torch.__file__)


@pytest.fixture(autouse=True, scope="module")
def _xla_first():
    labkit.setup("xla-cpu")  # XLA's devices start before any backward in this process (labkit.device says why)


# -- one compiled run: fp16 + GradScaler on the CPU, clip_norm, accumulation 3 over 7 batches, LR restarts -----------
class Plateau:
    """ReduceLROnPlateau, stepped as a learner steps it (from a callback, on a metric that never improves): it
    assigns a Python float to each param group's lr."""

    def __init__(self):
        self.sched, self.lrs = None, []

    def on_train_begin(self, trainer):
        self.sched = torch.optim.lr_scheduler.ReduceLROnPlateau(trainer.optimizer, patience=0, factor=0.9)

    def on_step_end(self, trainer, batch):
        self.lrs.append(float(trainer.optimizer.param_groups[0]["lr"]))
        self.sched.step(1.0)


@pytest.fixture(scope="module")
def compiled_run():
    rt = labkit.setup("cpu")
    torch._dynamo.reset()
    data = blobs(n=7 * 8 + 5, dim=8)  # 8 loader batches: 7 of 8 rows, then a short one of 5
    model = mlp(dim=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = Plateau()
    dash = Dashboard(title="compiled", sink=ConsoleSink(io.StringIO()))
    trainer = Trainer(
        model,
        opt,
        rt,
        TrainConfig(
            epochs=2, log_every=2, eval_every=0, clip_norm=1.0, accum_steps=3, compile="on", compile_backend="eager"
        ),  # fmt: skip
        torch.utils.data.DataLoader(data, batch_size=8),
        scheduler=torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2),  # assigns a float each step
        callbacks=[plateau, dash],
        precision=Precision("fp16", "cpu", "the GradScaler's path, on the CPU"),
    )
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.fit()
        info = labkit.explain(dash, verbose=False)
    yield trainer, dash, plateau, info, out.getvalue()
    torch._dynamo.reset()  # later modules count their own compiles


def test_compiled_run_blames_nothing_on_the_code_and_names_torchs_own_by_registry_id(compiled_run):
    trainer, dash, _, info, _ = compiled_run
    rec = dash.health.record
    assert rec.breaks("yours") == [] and rec.breaks("labkit") == [] and rec.breaks("unknown") == []
    ids = {b["gb_id"] for b in rec.breaks("torch")}
    # _use_grad, the GradScaler's functions Dynamo skips (clip_grad_norm_'s grouping, GB0208, is a break only where
    # torch cannot trace it: not once torch_xla is loaded, so the identity test below covers it)
    assert {"GB0025", "GB0008"} <= ids <= set(boundaries.BY_ID), ids
    lines = health_lines(dash.frame())
    assert any(ln.startswith("graph breaks: yours: 0, labkit's: 0, torch's own: ") for ln in lines), lines
    assert "graph breaks: yours: 0, labkit's: 0, torch's own:" in info["text"]
    assert info["breaks"] == [] and not any("Graph break" in a or "Fix:" in a for a in info["advice"]), info
    assert all("nothing to fix" in n for n in info["notes"]) and len(info["notes"]) == len(rec.breaks("torch"))


def test_schedulers_that_write_a_float_keep_the_compiled_steps_tensor_lr(compiled_run):
    trainer, dash, plateau, _, _ = compiled_run
    assert trainer.step == 4
    lrs = plateau.lrs
    assert any(b > a for a, b in zip(lrs, lrs[1:])), f"no warm restart seen: {lrs}"
    last = trainer.optimizer.param_groups[0]["lr"]  # the plateau's float, written after the last step
    assert isinstance(last, float)
    trainer.capture.keep_tensor_lr(trainer.optimizer)  # what the compiled step does before it runs
    lr = trainer.optimizer.param_groups[0]["lr"]
    assert torch.is_tensor(lr) and lr.item() == pytest.approx(last)
    assert dash.health.record.recompiles() == [], [e["guard"] for e in dash.health.record.recompiles()]


def test_each_epochs_dropped_samples_are_said_once_with_why(compiled_run):
    *_, out = compiled_run
    said = [ln for ln in out.splitlines() if "each epoch leaves out" in ln]
    assert len(said) == 1, out  # two epochs, one fit(): said once
    assert "5 in the short last batch" in said[0] and "8 in the last 1 batch(es), fewer than accum_steps=3" in said[0]


# -- the table itself: torch's registry, identity not spelling, nothing unproven blamed ----------------------------
def _payload(file, line, gb_type, explanation, context, gb_id, frames=()):
    """A dynamo_graph_break_reason payload as torch 2.9 writes it (exc.format_graph_break_message + the link)."""
    tb = "".join(f'  File "{f}", line {n}, in fn\n    code\n' for f, n in frames)
    return (
        f"Graph break in user code at {file}:{line}\nGraph Break Reason: {gb_type}\n  Explanation: {explanation}\n\n"
        f"  Developer debug context: {context}\n\n For more details about this graph break, please visit: "
        f"https://meta-pytorch.github.io/compile-graph-break-site/gb/gb{gb_id[2:]}.html\n"
        f"User code traceback:\n{tb}\n"
    )


def _recorded(payload):
    """The break as the compile record keeps it: the payload reaches the record the way torch sends it, a record
    on torch's structured trace logger with the dynamo_graph_break_reason artifact."""
    record = logging.makeLogRecord({"levelno": logging.DEBUG, "levelname": "DEBUG", "payload": payload,
                                    "metadata": {"artifact": {"name": "dynamo_graph_break_reason"}}})  # fmt: skip
    with CompileRecord() as rec:
        logging.getLogger("torch.__trace").handle(record)
        (ev,) = rec.take()
    return ev


def test_the_table_matches_torchs_registry():
    reg = boundaries.registry()
    assert reg, "torch ships no graph_break_registry.json"
    for b in boundaries.TORCH_BOUNDARIES:
        assert reg.get(b.gb_type) == b.gb_id, f"{b.gb_id} is no longer {b.gb_type!r} in this torch"


def test_a_break_is_torchs_only_by_id_and_identity(tmp_path):
    optimizer_py = os.path.join(TORCH_DIR, "optim", "optimizer.py")
    clone = tmp_path / "torch" / "optim"  # a folder of the learner's that happens to be called torch/optim
    clone.mkdir(parents=True)
    (clone / "mine.py").write_text("torch._dynamo.graph_break()\n")
    gb = ("Call to `torch._dynamo.graph_break()`", "User-inserted graph break.", "Called `graph_break()`", "GB0025")

    ours = _recorded(_payload(optimizer_py, 81, *gb, frames=[(optimizer_py, 81)]))
    assert ours["gb_id"] == "GB0025" and ours["owner"] == "torch"
    ev = _recorded(_payload(str(clone / "mine.py"), 1, *gb, frames=[(str(clone / "mine.py"), 1)]))
    assert ev["owner"] == "yours" and ev["torch_boundary"] is None  # "/torch/optim/" in a path proves nothing

    step = ("Unsupported method call", "Dynamo does not know how to trace method `step` of class `SGD`")
    wrapped = _recorded(_payload("/w/train.py", 9, *step, "call_method OptimizerVariable(SGD) step [] {}", "GB0156",
                                  frames=[("/w/train.py", 9)]))  # fmt: skip
    assert wrapped["owner"] == "torch"
    other = _recorded(_payload("/w/train.py", 9, "Unsupported method call", "no", "call_method "
                                "UserDefinedObjectVariable(Foo) bar [] {}", "GB0156", frames=[("/w/train.py", 9)]))  # fmt: skip
    assert other["owner"] == "yours"

    group = (
        "torch.* op returned non-Tensor",
        "x",
        "example_value type: dict; target: _group_tensors_by_device_and_dtype",
    )
    foreach = os.path.join(TORCH_DIR, "utils", "_foreach_utils.py")
    grouped = _recorded(_payload(foreach, 48, *group, "GB0208", frames=[("/w/a.py", 3), (foreach, 48)]))
    assert grouped["owner"] == "torch"
    mine = _recorded(_payload("/w/a.py", 3, *group, "GB0208", frames=[("/w/a.py", 3)]))
    assert mine["owner"] == "yours"

    skipped = ("Attempted to inline function marked as skipped", "Dynamo developers have intentionally marked ...")
    grad_scaler = os.path.join(TORCH_DIR, "amp", "grad_scaler.py")
    ctx = f"qualname: GradScaler.update, name: update, filename: `{grad_scaler}`, skip reason: MOD_SKIPLIST"
    assert _recorded(_payload("/w/a.py", 3, *skipped, ctx, "GB0008"))["owner"] == "torch"
    fake = f"qualname: GradScaler.update, name: update, filename: `{clone / 'mine.py'}`, skip reason: x"
    assert _recorded(_payload("/w/a.py", 3, *skipped, fake, "GB0008"))["owner"] == "yours"

    # inside torch, not one of its boundaries, and no line outside torch: whose it is is not proven, and said so
    inside = os.path.join(TORCH_DIR, "nn", "functional.py")
    ev = _recorded(_payload(inside, 5, "Data-dependent branching", "x", "y", "GB0170", frames=[(inside, 5)]))
    assert ev["owner"] == "unknown" and ev["torch_boundary"] is None
    from labkit.dashboard.rules import break_findings

    (f,) = break_findings([ev])
    assert "cannot tell whose" in f.advice and "Fix:" not in f.advice


# -- hooks left behind ---------------------------------------------------------------------------------------------
def _labkits(handlers):
    return [h for h in handlers if type(h).__module__.startswith("labkit.")]


def test_a_fit_that_raises_leaves_no_hook_behind():
    trace = logging.getLogger("torch.__trace")
    before = (list(trace.handlers), warnings.showwarning, signal.getsignal(signal.SIGTERM),
              signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGINT))  # fmt: skip
    seen = {}

    class Planted:
        def on_step_end(self, trainer, batch):
            seen["during"] = len(_labkits(trace.handlers))
            if trainer.step == 3:
                raise RuntimeError("planted mid-run")

    rt = labkit.setup("cpu")
    model = mlp(dim=8)
    dash = Dashboard(title="raises", sink=ConsoleSink(io.StringIO()))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), rt, TrainConfig(epochs=1, log_every=2),
                      torch.utils.data.DataLoader(blobs(n=64, dim=8), batch_size=8), callbacks=[Planted(), dash])  # fmt: skip
    with pytest.raises(RuntimeError, match="planted mid-run"):
        trainer.fit()
    assert seen["during"] >= 1  # the Dashboard listened during fit()
    after = (list(trace.handlers), warnings.showwarning, signal.getsignal(signal.SIGTERM),
             signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGINT))  # fmt: skip
    assert after == before and not dash.health.record.is_open
    if not _labkits(before[0]):  # alone in this process: nothing of labkit's listens to torch now
        assert _labkits(trace.handlers) == []


def test_the_sync_counter_puts_back_showwarning_and_its_filter():
    from labkit.dashboard.cuda_syncs import HostSyncCounter

    filters, show = list(warnings.filters), warnings.showwarning
    c = HostSyncCounter().start()
    assert warnings.showwarning != show and len(warnings.filters) == len(filters) + 1
    c.stop()
    assert warnings.showwarning == show and warnings.filters == filters


# -- chip peaks ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "chip, key, bf16",
    [("NVIDIA H100 NVL", "H100 NVL", 835e12), ("NVIDIA H200 NVL", "H200 NVL", 835e12),
     ("NVIDIA GH200 480GB", "GH200", 989e12), ("NVIDIA H100 80GB HBM3", "H100", 989e12),
     ("NVIDIA H200", "H200", 989e12)],
)  # fmt: skip
def test_nvl_cards_and_gh200_have_their_own_peaks(chip, key, bf16):
    from labkit.dashboard import flops

    assert flops.lookup(chip, "bf16") == (key, bf16)

    class Rt:
        def chip_name(self):
            return chip

    _, source = flops.peak_flops(Rt(), "bf16")
    assert source.startswith(f"{key} ({chip}): {bf16 / 1e12:.1f} TFLOP/s bf16 dense") and "data sheet" in source


# -- printed commands ----------------------------------------------------------------------------------------------
HOSTILE = ["run $(touch X)", "/content/drive/My Drive/x", "a'b {x} c"]


@pytest.mark.parametrize("name", HOSTILE)
def test_printed_commands_quote_paths_for_a_shell_and_a_notebook_line(tmp_path, name):
    from IPython.utils.text import DollarFormatter

    from labkit.profiling import viewers

    folder = tmp_path / name.lstrip("/") if name.startswith("/") else tmp_path / name
    (folder / "plugins" / "profile" / "r").mkdir(parents=True)
    (folder / "plugins" / "profile" / "r" / "h.xplane.pb").write_bytes(b"")
    shell = viewers.how_to_open(folder, colab=False).splitlines()
    board = next(ln.strip().split("   #")[0] for ln in shell if ln.strip().startswith("tensorboard "))
    out = subprocess.run(["bash", "-c", board.replace("tensorboard", "printf '%s\\n'", 1)], cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.splitlines()  # fmt: skip
    assert out == ["--logdir", str(folder.resolve())] and not (tmp_path / "X").exists()

    colab = viewers.how_to_open(folder, colab=True).splitlines()
    bang = next(ln.strip().split("   #")[0] for ln in colab if ln.strip().startswith("!pip"))
    magic = next(ln.strip() for ln in colab if ln.strip().startswith("%tensorboard"))
    ns = {"x": "EXPANDED", "touch": "EXPANDED"}  # names IPython would find in the learner's namespace
    expanded = DollarFormatter().vformat(bang[1:], args=[], kwargs=ns)  # what IPython hands the shell
    assert (
        "EXPANDED" not in expanded
        and str(folder.resolve() / "keep-installed.txt")
        in subprocess.run(
            ["bash", "-c", expanded.replace("pip install", "printf '%s\\n'", 1)], capture_output=True, text=True
        ).stdout.splitlines()
    )
    import shlex

    assert shlex.split(DollarFormatter().vformat(magic[1:], args=[], kwargs=ns)) == [
        "tensorboard",
        "--logdir",
        str(folder.resolve()),
    ]  # fmt: skip  (tensorboard's magic splits as shlex does)


def test_the_console_twins_trigger_command_is_quoted(monkeypatch, tmp_path):
    from labkit.dashboard import controls

    trigger = tmp_path / "run $(touch X)" / "PROFILE"
    monkeypatch.setattr(controls, "profile_trigger", lambda: str(trigger))
    line = controls.script_help(123)[0]
    cmd = line.split("/ `", 1)[1].split("`", 1)[0]
    subprocess.run(["bash", "-c", cmd.replace("touch", "printf '%s'", 1)], cwd=tmp_path, check=True,
                   capture_output=True)  # fmt: skip
    assert not (tmp_path / "X").exists()


def test_the_missing_bucket_advice_quotes_the_bucket(tmp_path):
    from labkit.cloud import gcs

    # the advice's own quoting, called directly: ensure_bucket refuses such a name before it asks GCS (check_bucket)
    msg = str(gcs._missing("b $(touch X)", "gs://b $(touch X)/data"))
    cmd = msg.split("region: ", 1)[1]
    out = subprocess.run(["bash", "-c", cmd.replace("gcloud", "printf '%s\\n'", 1)], cwd=tmp_path, check=True,
                         capture_output=True, text=True).stdout.splitlines()  # fmt: skip
    assert "gs://b $(touch X)" in out and not (tmp_path / "X").exists()


# -- the command line ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--accum-steps", "0"], "--accum-steps"),
        (["--max-steps", "-3"], "--max-steps"),
        (["--optimizer", "adamm"], "--optimizer"),
        (["--precision", "bf61"], "--precision"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "inf"], "--lr"),
        (["--batch-size", "0"], "--batch-size"),
        (["--epochs", "1.5"], "--epochs"),
        (["--num-workers", "-1"], "--num-workers"),
        (["--spmd", "sometimes"], "--spmd"),
        (["--source", "mnist"], "--source"),
        (["--upsample", "0"], "--upsample"),
        (["--backend", "gpu"], "--backend"),
    ],
)
def test_a_bad_flag_is_argparses_one_line_error_before_any_set_up(monkeypatch, capsys, flags, flag):
    from labkit import train

    monkeypatch.setattr(train, "_runtime", lambda *a: pytest.fail("set-up ran"))
    with pytest.raises(SystemExit) as e:
        train.main(["resnet", "--fast", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err[-1].startswith(f"python -m labkit.train resnet: error: argument {flag}: ")
    assert "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("flags, flag", [(["--dropout", "1.5"], "--dropout"), (["--temperature", "0"], "--temperature"),
                                         (["--max-steps", "0"], "--max-steps"), (["--n-head", "-2"], "--n-head")])  # fmt: skip
def test_gpt_flags_too(monkeypatch, capsys, flags, flag):
    from labkit import train

    monkeypatch.setattr(train, "_runtime", lambda *a: pytest.fail("set-up ran"))
    with pytest.raises(SystemExit) as e:
        train.main(["gpt", *flags])
    assert e.value.code == 2 and f"error: argument {flag}: " in capsys.readouterr().err


def test_an_environment_value_is_the_same_error_naming_the_variable(monkeypatch, capsys):
    from labkit import train

    monkeypatch.setenv("LABKIT_ACCUM_STEPS", "0")
    monkeypatch.setattr(train, "_runtime", lambda *a: pytest.fail("set-up ran"))
    with pytest.raises(SystemExit) as e:
        train.main(["resnet", "--fast"])
    assert e.value.code == 2 and "error: LABKIT_ACCUM_STEPS=0: expected an integer >= 1" in capsys.readouterr().err


# -- numbers taken on trust ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fn, args, name",
    [
        ("scaled_lr", (float("nan"), 128, 256), "lr"),
        ("scaled_lr", (float("inf"), 128, 256), "lr"),
        ("scaled_lr", (-0.1, 128, 256), "lr"),
        ("scaled_lr", (0.1, True, 256), "base_batch"),
        ("scaled_lr", (0.1, 128, 256.0), "global_batch"),
        ("scaled_lr", (0.1, 0, 256), "base_batch"),
        ("WarmupCosine", (True, 10), "warmup"),
        ("WarmupCosine", (1, 10, float("nan")), "floor"),
        ("WarmupCosine", (1, 10, 1.5), "floor"),
    ],
)
def test_numbers_are_refused_by_name(fn, args, name):
    from labkit import optim

    with pytest.raises(ValueError, match=name):
        getattr(optim, fn)(*args)


def test_from_env_and_batch_plans_refuse_bools_and_non_finite_numbers(monkeypatch):
    from labkit.config import from_env
    from labkit.spmd.mesh import batch_plan
    from labkit.train import ResNetParams

    with pytest.raises(ValueError, match=r"ResNetParams\.batch_size=True: expected a number, not a bool"):
        from_env(ResNetParams, batch_size=True)
    with pytest.raises(ValueError, match=r"ResNetParams\.lr=nan"):
        from_env(ResNetParams, lr=float("nan"))
    with pytest.raises(ValueError, match="TrainConfig.log_every"):
        TrainConfig(log_every=True)
    monkeypatch.setenv("LABKIT_LR", "inf")
    with pytest.raises(ValueError, match="LABKIT_LR"):
        from_env(ResNetParams)
    with pytest.raises(ValueError, match="batch size per chip"):
        batch_plan(labkit.setup("cpu"), True)
    from data_tools.stream import ShardStream

    for bad in (True, 2.5):
        with pytest.raises(ValueError, match=r"batch_size=.*expected an integer >= 1"):
            ShardStream(["unused.tar"], bad, train=False)
    from labkit.dashboard import flops

    for bad in ("nan", "-1", "0", "fast"):
        monkeypatch.setenv("LABKIT_PEAK_FLOPS", bad)
        with pytest.raises(ValueError, match="LABKIT_PEAK_FLOPS"):
            flops.peak_flops(None)


# -- servers left behind -------------------------------------------------------------------------------------------
def _servers_under(root: Path) -> list[int]:
    """pids of fake-gcs-server processes whose filesystem root is `root` (read from /proc)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (p / "cmdline").read_bytes().split(b"\0")
                if any(b"fake-gcs-server" in a for a in argv[:1]) and str(root).encode() in argv:
                    pids.append(int(p.name))
    return pids


def _gone(root: Path, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while _servers_under(root) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _servers_under(root)


def test_a_failing_train_run_stops_its_gcs_server(monkeypatch, tmp_path):
    from labkit import train
    from labkit.lessons import recipes

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    seen = {}

    def fails(*a, **kw):  # the first thing after the server starts
        seen["running"] = _servers_under(tmp_path / "data" / "local-gcs")
        raise OSError("planted: the data could not be written")

    monkeypatch.setattr(recipes, "image_shards", fails)
    with pytest.raises(OSError, match="planted"):
        train.main(["resnet", "--fast", "--backend", "cpu", "--spmd", "off"])
    assert seen["running"], "the server never started: the test proves nothing"
    assert _gone(tmp_path / "data" / "local-gcs") and "STORAGE_EMULATOR_HOST" not in os.environ


def test_the_gcs_server_dies_with_a_parent_killed_by_sigkill(tmp_path):
    script = (
        "import sys, time\nfrom labkit.cloud.emulator import LocalGCSServer\n"
        "LocalGCSServer(root=sys.argv[1]).start()\nprint('up', flush=True)\ntime.sleep(120)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline().strip() == b"up"
        assert _servers_under(tmp_path)
        child.kill()  # SIGKILL: no finally, no atexit
        child.wait()
        assert _gone(tmp_path), "fake-gcs-server outlived the process that started it"
    finally:
        child.kill()
        for pid in _servers_under(tmp_path):
            os.kill(pid, signal.SIGKILL)


# -- house ---------------------------------------------------------------------------------------------------------
def test_no_data_tools_module_imports_a_siblings_private_name():
    bad = []
    for path in sorted((ROOT / "data_tools").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                bad += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert bad == []
