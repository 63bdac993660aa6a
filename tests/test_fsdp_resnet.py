"""FSDP2 the way a GPU node runs it: a ResNet with BatchNorm in bf16, an evaluation set that does not split evenly,
per-process RNG, a NaN on one process, and `python -m labkit.train` under torchrun stopped by SIGTERM to torchrun
itself and resumed from the same folder.

One torchrun of 2 gloo processes runs tests/children/fsdp_resnet.py (its docstring lists the runs); each test
below reads its part of the report. Before labkit.parallel's BatchNorm units the bf16 run died at its first
BatchNorm ("expected scalar type BFloat16 but found Float"); before Processes.lockstep the evaluation over 3 + 2
batches never ended (an all-gather on one process against the metrics' all-reduce on the other); before StepVote
carried problems, process 1 waited in its next collective while process 0 raised.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_fsdp_trainer import _env, _start, _wait

heavy = pytest.mark.heavy
ROOT = Path(__file__).resolve().parent.parent
CHILD = str(ROOT / "tests" / "children" / "fsdp_resnet.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp-resnet")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", CHILD]
    proc, log = _start(cmd + [str(tmp / "out.json"), str(tmp / "ck")], tmp / "log.txt")
    code, text = _wait(proc, log, 300)  # ~45 s alone; a hang (the old evaluation) is killed here
    assert code == 0 and (tmp / "out.json").exists(), f"exit {code}:\n{text[-4000:]}"
    return json.loads((tmp / "out.json").read_text())


def _ok(run):
    assert "error" not in run, run.get("trace", run)
    return run


@heavy
def test_resnet_trains_under_fsdp2_in_bf16_with_batchnorm_in_float32(report):
    r = _ok(report["bf16"])
    assert r["plan"] == "fsdp2 over 2 processes (bf16 gathers, fp32 reduction)"
    assert r["bn_weight_dtype"] == "torch.float32"
    assert len(r["losses"]) == 3 and all(0 < v < 10 for v in r["losses"])


@heavy
def test_batchnorms_are_one_unit_per_block_and_stay_gathered_through_accumulation(report):
    """ResNet-18 under bf16: 8 blocks, 20 BatchNorms in 9 units (a block's, and the stem's), kept gathered after
    forward. A step gathers the root, each block in forward and all but the last again in backward, and each
    BatchNorm unit once: 1 + 8 + 7 + 9 = 25 all-gathers and 8 + 1 + 9 = 18 reduce-scatters (56 and 29 with a unit
    per BatchNorm, freed after forward). Accumulated gathered at k = 2, the same per optimizer step (76 all-gathers
    when the BatchNorm units were gathered again each micro-batch); float32 has no BatchNorm units: 16 and 9."""
    import torchvision

    from labkit.parallel import batchnorm_groups, units

    model = torchvision.models.resnet18()
    groups, blocks = batchnorm_groups(model), units(model)
    assert len(blocks) == 8 and len(groups) == 9 and sum(map(len, groups)) == 20
    assert len(batchnorm_groups(torchvision.models.resnet50())) == 17  # 53 BatchNorms
    b, g = len(blocks), len(groups)
    bf16, k2, fp32 = _ok(report["bf16"])["comm"], _ok(report["bf16_k2"])["comm"], _ok(report["fp32"])["comm"]
    assert bf16["all-gather"][0] == 1 + b + (b - 1) + g and bf16["reduce-scatter"][0] == b + 1 + g, bf16
    assert "accumulation gathered" in report["bf16_k2"]["plan"] and k2 == bf16, (bf16, k2)
    assert fp32["all-gather"][0] == 1 + b + (b - 1) and fp32["reduce-scatter"][0] == b + 1, fp32


@heavy
def test_evaluation_over_uneven_shares_ends_and_equals_one_process(report):
    """3 batches on process 0, 2 on process 1: the evaluation ends on both (padding forwards count nothing) and its
    metrics equal one process's over all 5 batches with the same weights and statistics."""
    for name in ("bf16", "fp32"):
        assert _ok(report[name])["val"]["step"] == 3
    r = report["fp32"]
    assert abs(r["val"]["val_loss"] - r["one_process"]["val_loss"]) < 1e-5, r
    assert r["val"]["val_acc"] == r["one_process"]["val_acc"]


@heavy
def test_batchnorm_statistics_agree_across_processes_after_evaluation(report):
    assert _ok(report["bf16"])["buffers_equal"] and report["fp32"]["buffers_equal"]


@heavy
def test_each_process_resumes_its_own_rng(report):
    r = _ok(report["rng"])
    assert r["differ"], "the two processes' generators were seeded apart: their saved states must differ"
    assert r["restored_own"] == [True, True] and r["step"] == 2


@heavy
def test_nan_on_one_process_stops_every_process_at_one_step(report):
    r = _ok(report["nan"])
    assert r["raised"][0] is not None and r["raised"][0] == r["raised"][1], r
    assert "on process 0 of 2" in r["raised"][0] and r["steps"][0] == r["steps"][1]


@heavy
def test_one_run_folder_whatever_each_process_clock_says(report):
    folders = _ok(report["folder"])["folders"]
    assert len(set(folders)) == 1 and "/run-" in folders[0], folders


# -- python -m labkit.train under torchrun ------------------------------------------------------------------------
def _script(tmp, name, extra, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += ["-m", "labkit.train", "gpt", "--fast", "--backend", "cpu", "--parallel", "fsdp2"]
    cmd += ["--save-to", str(tmp / "ck"), "--log-every", "1", "--evals", "1"]
    return _start(cmd + extra, tmp / f"{name}.log")


@heavy
def test_sigterm_to_torchrun_saves_once_and_resume_continues_at_the_next_step(tmp_path):
    """SIGTERM to torchrun (what a Spot VM's shutdown sends the process tree's leader): torchrun forwards it to its
    workers and SIGKILLs them 30 s later (torch.distributed.elastic's default). Both workers save the same step
    inside that window and exit 143; `--resume` continues at the next step. The gpt recipe: its steps are short,
    so the signal lands mid-run whenever it comes (a save every 2 steps, DCP, both processes writing)."""
    proc, log = _script(tmp_path, "first", ["--save-every", "2", "--max-steps", "100000"])
    deadline, text = time.time() + 240, ""
    while time.time() < deadline and proc.poll() is None:
        text = (tmp_path / "first.log").read_text()
        if "step      5" in text:
            break
        time.sleep(0.2)
    assert "step      5" in text, text[-3000:]
    t0 = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    code, text = _wait(proc, log, 60)
    stopped_s = time.time() - t0
    assert code != "timed out" and stopped_s < 30, (stopped_s, text[-3000:])
    assert text.count("Preempted: SIGTERM") == 2, text[-3000:]  # both workers, one line each, no traceback
    # the workers end in one line each; torchrun itself then prints its own SignalException traceback, the only one
    assert text.count("Traceback (most recent call last)") <= 1 and "SignalException" in text, text[-3000:]
    committed = sorted(int(p.parent.name.split("-")[1]) for p in (tmp_path / "ck").glob("step-*/COMMITTED"))
    assert committed and committed[-1] >= 5, committed
    stop = committed[-1]
    assert f"every process stopped after step {stop} and saved it" in text, text[-3000:]
    proc, log = _script(tmp_path, "resume", ["--resume", "--max-steps", str(stop + 2)])
    code, text = _wait(proc, log, 240)
    assert code == 0, text[-3000:]
    assert f"resumed at step {stop} " in text and f"step {stop + 1:6d}" in text, text[-3000:]
    assert f"step {stop:6d}" not in text.split("resumed at step")[-1], text[-3000:]
    print(f"[sigterm to torchrun] every worker ended {stopped_s:.1f} s after the signal; resumed after step {stop}")


def test_resume_latest_is_the_newest_run_folder(tmp_path):
    """`--resume` without a folder (resnet): the newest run-* folder under --checkpoint-dir; none: one line."""
    from labkit.runtime import Runtime
    from labkit.train import SettingError, run_folder

    rt = Runtime("cpu", torch.device("cpu"), 1, 0, 0, 1, False, {})
    for name in ("run-20261101-000000", "run-20261128-120000", "run-20261105-000000"):
        (tmp_path / name / "step-00000002").mkdir(parents=True)
        (tmp_path / name / "step-00000002" / "COMMITTED").write_text("{}")
    assert run_folder(rt, str(tmp_path), "latest") == f"{tmp_path}/run-20261128-120000"
    assert run_folder(rt, str(tmp_path), "gs://b/run-x") == "gs://b/run-x"
    assert run_folder(rt, str(tmp_path), None).startswith(f"{tmp_path}/run-")
    with pytest.raises(SettingError, match="no run-\\* folder under"):
        run_folder(rt, str(tmp_path / "empty"), "latest")


def test_bad_parallel_settings_are_one_line(tmp_path):
    """--parallel fsdp2 without torchrun, and LABKIT_PARALLEL=fsdp: one line naming the setting, exit 2."""
    base = [sys.executable, "-m", "labkit.train", "gpt", "--fast", "--backend", "cpu", "--max-steps", "2"]
    for extra, env in ((["--parallel", "fsdp2"], {}), ([], {"LABKIT_PARALLEL": "fsdp"})):
        out = subprocess.run(base + extra, cwd=ROOT, env={**_env(), **env}, capture_output=True, text=True, timeout=180)
        assert out.returncode == 2, out.stderr[-2000:]
        assert "Traceback" not in out.stderr, out.stderr[-2000:]
        last = out.stderr.strip().splitlines()[-1]
        assert ("TrainConfig.parallel='fsdp2' needs torchrun" in last) or ("LABKIT_PARALLEL='fsdp'" in last), last


def test_a_shard_stream_is_named_by_its_samples_over_every_process():
    """A shard stream's len() is this process's batches, which another number of processes changes (44 on 4, 89 on
    2): a resume on 2 of a 4-process checkpoint was refused as "another dataset". Its identity is the samples of
    every shard."""
    from labkit import resume

    class Stream:
        num_samples, batch_size, generation = 1437, 8, "g1"

        def __len__(self):
            return 44

    class Loader:
        dataset, batch_size = Stream(), None

    assert resume.dataset_identity(Loader()) == {"total_samples": 1437, "generation": "g1"}
    saved = {"dataset": {"total_samples": 1437, "generation": "g1"}, "batch_in_epoch": 4, "samples_in_epoch": 128}
    resume.check_data(saved, Loader())  # the same data on another number of processes: no refusal
    with pytest.raises(ValueError, match="another dataset"):
        resume.check_data({**saved, "dataset": {"total_samples": 999}}, Loader())


@heavy
def test_channels_last_holds_under_ddp_and_fsdp2_with_the_losses_of_nchw(report):
    """memory_format="channels_last" under both plans: every batch reaches the step in channels_last; DDP keeps the
    weights in it, FSDP2 keeps them contiguous (fully_shard refuses channels_last parameters); the first step's loss
    (the same weights) equals NCHW's to float32 rounding (later steps of this 16 px, batch-4 ResNet-18 amplify a
    rounding through BatchNorm's cancellations; tests/test_memory_format.py compares trajectories on a better
    conditioned one). Before labkit.runtime.layout, TrainConfig had no memory_format and nothing was channels_last."""
    r = _ok(report["layout"])
    for plan, weight_cl in (("replicate", True), ("fsdp2", False)):
        cl, nchw = r[f"{plan} channels_last"], r[f"{plan} contiguous"]
        assert cl["seen"] == [[True, weight_cl]] * 3, (plan, cl["seen"])
        assert nchw["seen"] == [[False, False]] * 3, (plan, nchw["seen"])
        assert len(cl["losses"]) == 3
        a, b = cl["losses"][0], nchw["losses"][0]
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (plan, cl["losses"], nchw["losses"])
