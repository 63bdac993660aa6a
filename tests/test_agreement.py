"""No process decides, fails or stops alone: cases on 2 gloo processes under one torchrun launch
(tests/children/agreement.py), FSDP2 on a tiny GPT, and what one process can check without a launch.

The launch runs every case in order (one launch costs ~15 s of CPU here; each case 1-3 s):
- plan: LABKIT_MEMORY_MB of 0.5 MB on process 0 and 1000 MB on process 1; "auto" plans from the smaller on both.
- asks: a callback's on_log (process 0 only) asks for a checkpoint at step 2 and a stop at step 3: both processes
  save step 2 and stop after step 3.
- refuse_all / refuse_one: a resume whose dataset differs on every process / on process 1 only is refused on every
  process, from the commit record, before DCP reads anything into the model.
- prune: process 0's prune fails after a good commit: a warning on both, the run goes on.
- stage_fail: the CPU copy of a background save fails on process 1: both raise, naming it, nothing committed.
- reads: process 1's own reads of the store would see a step 999: latest() and the older-step rule take process 0's.
- eval_first: an evaluation before any step, process 1 without an evaluation batch: both raise, naming process 1.
- state_dict: Trainer.state_dict() in on_log (process 0 alone) raises instead of hanging; every process after fit().
- timeouts: the step vote's, the lockstep's and the checkpoint's groups wait LABKIT_DIST_TIMEOUT_S.
- prep_wait: a wait for another process's data preparation goes through the store and names what it waited for.
LABKIT_DIST_TIMEOUT_S=60: a case where one process went on alone fails within a minute instead of hanging.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.test_fsdp_trainer import _start, _wait

heavy = pytest.mark.heavy
ROOT = Path(__file__).resolve().parent.parent
CHILD = str(ROOT / "tests" / "children" / "agreement.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agree")
    ck, asks = str(tmp / "ck"), str(tmp / "asks")
    runs = [
        {"name": "plan", "case": "plan", "parallel": "auto", "budget_mb": [0.5, 1000], "accum_steps": 2, "steps": 2},
        {"name": "asks", "case": "asks", "ckpt": asks, "steps": 6, "save_at": 2, "ask_stop_at": 3},
        {"name": "save", "case": "train", "ckpt": ck, "steps": 6, "stop_at": 2, "checkpoint_every": 2},
        {"name": "refuse_all", "case": "refuse", "ckpt": ck, "steps": 6, "more_data_on": [0, 1]},
        {"name": "refuse_one", "case": "refuse", "ckpt": ck, "steps": 6, "more_data_on": [1]},
        {"name": "prune", "case": "prune", "ckpt": str(tmp / "prune"), "steps": 6, "checkpoint_every": 2},
        {"name": "stage_fail", "case": "stage_fail", "ckpt": str(tmp / "stage"), "steps": 4, "checkpoint_every": 2},
        {"name": "reads", "case": "reads", "ckpt": str(tmp / "reads"), "steps": 2, "checkpoint_every": 2},
        {"name": "eval_first", "case": "eval_first", "steps": 2},
        {"name": "state_dict", "case": "state_dict", "steps": 2},
        {"name": "timeouts", "case": "timeouts", "ckpt": str(tmp / "timeouts"), "steps": 2, "checkpoint_every": 2},
        {"name": "prep_wait", "case": "prep_wait"},
        {"name": "settings", "case": "settings", "steps": 2, "lr": [0.01, 0.02], "a_step_more_on": [1]},
        {"name": "settings_alike", "case": "settings", "steps": 2},
        {"name": "eval_save", "case": "boundary", "ckpt": str(tmp / "eval_save"), "steps": 2, "stop_at": 4,
         "epochs": 2, "eval_every": 1, "checkpoint_every": 1000, "save_on": [0]},
        {"name": "eval_term", "case": "boundary", "ckpt": str(tmp / "eval_term"), "steps": 2, "stop_at": 4,
         "epochs": 2, "eval_every": 1, "checkpoint_every": 1000, "term_on": [1]},
    ]  # fmt: skip
    job = {"out": str(tmp / "out.json"), "runs": runs}
    (tmp / "job.json").write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", CHILD]
    t0 = time.perf_counter()
    env = {"LABKIT_DIST_TIMEOUT_S": "60", "LABKIT_CKPT_TIMEOUT_S": "90"}
    proc, log = _start(cmd + [str(tmp / "job.json")], tmp / "run.log", env=env)
    code, text = _wait(proc, log, 300)
    print(f"[agreement] {time.perf_counter() - t0:.1f} s")
    out = json.loads((tmp / "out.json").read_text()) if (tmp / "out.json").exists() else {}
    return {"code": code, "text": text, "tmp": tmp, **out}


def _case(report, name):
    assert name in report, f"{name} did not finish (exit {report['code']}):\n{report['text'][-4000:]}"
    return report[name]


@heavy
def test_the_plan_is_decided_from_the_smallest_memory(report):
    every = _case(report, "plan")
    assert all("error" not in r for r in every), every
    plans = [r["plan"] for r in every]
    assert plans[0] == plans[1] and plans[0].startswith("fsdp2 over 2"), plans  # 0.5 MB: a copy does not fit
    assert "accumulation sharded" in plans[0], plans


@heavy
def test_a_callbacks_stop_and_save_on_process_0_are_every_process(report):
    every = _case(report, "asks")
    assert [r.get("error") for r in every] == [None, None], every
    assert [r["step"] for r in every] == [3, 3], every
    assert every[0]["saved"] == ["step-00000002"], every
    marker = json.loads((report["tmp"] / "asks" / "step-00000002" / "COMMITTED").read_text())
    assert marker["processes"] == 2 and marker["position"]["step"] == 2, marker


@heavy
def test_a_refused_resume_leaves_the_model_and_every_process_refuses(report):
    assert all("error" not in r for r in _case(report, "save")), report["save"]
    for name in ("refuse_all", "refuse_one"):
        every = _case(report, name)
        errors = [r.get("error", "") for r in every]
        assert all(e.startswith("Refused: ") and "another dataset" in e for e in errors), (name, every)
        assert [r["unchanged"] for r in every] == [True, True], (name, every)  # DCP read nothing into the model
        assert [r["step"] for r in every] == [0, 0], (name, every)
    assert "process 1 of 2" in report["refuse_one"][0]["error"], report["refuse_one"]


@heavy
def test_a_failed_prune_after_a_good_commit_is_a_warning_on_every_process(report):
    every = _case(report, "prune")
    assert [r.get("error") for r in every] == [None, None] and [r["step"] for r in every] == [6, 6], every
    for r in every:
        said = " ".join(r["warnings"])
        assert "is committed, but removing the steps it replaces failed on process 0" in said, every
        assert "cannot delete" in said, said
    assert every[0]["saved"][-1] == "step-00000006", every  # the next saves and prunes went on


@heavy
def test_a_staging_failure_on_one_process_fails_the_save_on_all(report):
    every = _case(report, "stage_fail")
    errors = [r.get("error", "") for r in every]
    assert "staging failed on this host" in errors[1], every  # its own error
    assert "failed on process 1 of 2" in errors[0] and "staging failed" in errors[0], every  # named, not a timeout
    assert [r["step"] for r in every] == [2, 2] and every[0]["saved"] == [], every


@heavy
def test_reads_of_the_store_are_process_0s(report):
    every = _case(report, "reads")
    assert [r.get("error") for r in every] == [None, None], every  # process 1 did not refuse alone
    assert [r["latest"] for r in every] == [None, None], every  # an empty folder, as process 0 read it


@heavy
def test_an_evaluation_no_process_can_pad_raises_on_every_process(report):
    errors = [r.get("error", "") for r in _case(report, "eval_first")]
    assert all(e.startswith("RuntimeError: evaluation: process 1 of 2 has no evaluation batch") for e in errors), errors


@heavy
def test_state_dict_in_on_log_is_refused_and_every_process_may_call_it(report):
    every = _case(report, "state_dict")
    assert [r.get("error") for r in every] == [None, None] and [r["step"] for r in every] == [2, 2], every
    assert "on_log, which runs on process 0 only" in (every[0]["said"] or ""), every
    assert every[1]["said"] is None and every[0]["keys"] == every[1]["keys"] and "model" in every[0]["keys"], every


@heavy
def test_side_groups_wait_labkit_dist_timeout_s(report):
    every = _case(report, "timeouts")
    assert [r.get("error") for r in every] == [None, None], every
    assert every[0]["timeouts"] == {"vote": 60.0, "checkpoint": 90.0, "lockstep": 60.0}, every  # each its own


@heavy
def test_a_wait_for_data_preparation_goes_through_the_store_and_names_its_wait(report):
    every = _case(report, "prep_wait")
    assert [r.get("passed") for r in every] == [True, True], every  # the same tag again: a new wait, passed
    said = every[1].get("error", "")
    assert said.startswith("waiting for process 0's data: process 1 of 2 waited 1 s") and "'prep'" in said, every
    assert "error" not in every[0], every


@heavy
def test_settings_that_differ_between_processes_are_refused_on_every_process_by_name(report):
    """A learning rate of 0.02 on process 1 (its LABKIT_LR, say) and a batch more of data there: the Trainer's
    construction raises on both processes, naming each setting, its values and the processes holding them."""
    errors = [r.get("error", "") for r in _case(report, "settings")]
    for e in errors:
        assert e.startswith("SettingsDiffer: the 2 processes resolved the Trainer's settings differently"), errors
        assert "optimizer group 0 lr: 0.01 on process 0; 0.02 on process 1" in e, errors
        assert "steps_per_epoch(): 2 on process 0; 3 on process 1" in e, errors
    assert [r.get("error") for r in _case(report, "settings_alike")] == [None, None], report["settings_alike"]


@heavy
def test_a_save_or_sigterm_asked_during_evaluation_acts_at_the_epochs_end(report):
    """Epochs of 2 steps, evaluated after each. A save asked from on_eval (process 0) saves step 2 at the position
    "epoch 1, batch 0", not after step 3; SIGTERM to process 1 during the evaluation saves step 2 there and stops
    every process (Preempted) before the second epoch's first step."""
    every = _case(report, "eval_save")
    assert [r.get("error") for r in every] == [None, None] and [r["step"] for r in every] == [4, 4], every
    assert every[0]["saved"] == ["step-00000002"], every
    marker = json.loads((report["tmp"] / "eval_save" / "step-00000002" / "COMMITTED").read_text())
    assert marker["position"]["epoch"] == 1 and marker["position"]["batch_in_epoch"] == 0, marker
    every = _case(report, "eval_term")
    assert [r["step"] for r in every] == [2, 2] and [r["position"] for r in every] == [[1, 0], [1, 0]], every
    assert all(r.get("error", "").startswith("Preempted: SIGTERM to") for r in every), every
    assert "another process" in every[0]["error"] and "this process" in every[1]["error"], every
    assert every[0]["saved"] == ["step-00000002"], every
    marker = json.loads((report["tmp"] / "eval_term" / "step-00000002" / "COMMITTED").read_text())
    assert marker["position"]["epoch"] == 1 and marker["position"]["batch_in_epoch"] == 0, marker


def test_side_groups_under_nccl_get_labkit_dist_timeout_s(monkeypatch):
    """Under NCCL the step vote and the lockstep make gloo groups of their own: each gets LABKIT_DIST_TIMEOUT_S, not
    gloo's 30 minutes. The checkpoint's group waits LABKIT_CKPT_TIMEOUT_S (else an hour), whatever the first says."""
    import torch
    import torch.distributed as dist

    from labkit.checkpoint.together import checkpoint_group
    from labkit.interrupts import StepVote
    from labkit.parallel.plans import Processes, _cpu_group
    from labkit.runtime import Runtime

    made = []
    monkeypatch.setenv("LABKIT_DIST_TIMEOUT_S", "42")
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda **k: made.append(k) or object())
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)
    rt = Runtime("cuda", torch.device("cpu"), 2, 0, 0, 1, False, {})
    _cpu_group(Processes(rt))
    vote = StepVote(rt)
    vote.active = True
    vote.cast()
    checkpoint_group()
    assert [k.get("backend") for k in made] == ["gloo"] * 3, made
    # a short LABKIT_DIST_TIMEOUT_S, to catch hangs, leaves the checkpoint's own default: uploads take long
    assert [k.get("timeout") and k["timeout"].total_seconds() for k in made] == [42.0, 42.0, 3600.0], made
    monkeypatch.setenv("LABKIT_CKPT_TIMEOUT_S", "7200")
    checkpoint_group()
    assert made[-1]["timeout"].total_seconds() == 7200, made
    monkeypatch.setenv("LABKIT_CKPT_TIMEOUT_S", "soon")
    with pytest.raises(RuntimeError, match="LABKIT_CKPT_TIMEOUT_S=.soon."):
        checkpoint_group()


def test_gloo_reach_resolves_as_gloo_does_and_runs_once_per_host_at_setup(monkeypatch, capsys):
    """The host name resolved with AF_UNSPEC (gloo's getaddrinfo): an IPv6-only ::1 is found, and named as a loopback
    address the other hosts cannot reach. labkit.setup() on torchrun over 2 hosts runs the check on local rank 0
    only, printing what it finds."""
    import socket

    import torch.distributed as dist

    from labkit import torchrun

    asked = []

    def resolve(host, port, family=0, *a):
        asked.append(family)
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0))]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500"}
    assert torchrun.gloo_address(env)[0] == "::1" and asked == [socket.AF_UNSPEC]
    said = torchrun.gloo_reach_warnings(env)
    assert len(said) == 1 and "gloo would use ::1" in said[0] and "loopback address" in said[0], said
    for k, v in {**env, "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "get_rank", lambda *a: 0)
    torchrun.setup_cpu()
    out = capsys.readouterr().out
    assert out.count("[labkit] torchrun over 2 hosts: gloo would use ::1") == 1, out
    monkeypatch.setenv("LOCAL_RANK", "1")
    torchrun.setup_cpu()
    assert "gloo" not in capsys.readouterr().out
