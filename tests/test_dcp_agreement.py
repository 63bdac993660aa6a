"""Sharded checkpoints under torchrun as decisions every process takes together (labkit.checkpoint.dcp, manager).

Two torchrun launches of 2 gloo processes (tests/children/dcp_agreement.py), FSDP2 on a tiny GPT:
- one launch, three runs: a run saves steps 2, 4 and 6 in the background (DCP's async_save); a byte is flipped in the
  middle of process 1's shard of step 6; a resumed run finds it on one process, and both fall back to step 4 (the
  warning names the file and the process), resuming at step 5 with the uninterrupted run's losses, and save step 6
  again over the damaged one (it then reads back); then each process
  saves under a folder of its own (a local folder on two hosts): the save fails by name, nothing committed.
- SIGTERM to torchrun itself (what a stopped job gets), a save slowed to DELAY_S in its writer thread: torchrun
  forwards it to its workers and SIGKILLs them 30 s later (torch 2.9: PContext.close(death_sig, timeout=30) in
  torch/distributed/elastic/multiprocessing/api.py, called by LocalElasticAgent._shutdown in
  torch/distributed/elastic/agent/server/local_elastic_agent.py). Every worker saves the same step, training stops,
  the save commits within the window, every worker exits on its own, and the committed step reads back.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.test_fsdp_trainer import _start, _wait

heavy = pytest.mark.heavy
ROOT = Path(__file__).resolve().parent.parent
CHILD = str(ROOT / "tests" / "children" / "dcp_agreement.py")
TORCHRUN_GRACE_S = 30  # torchrun's SIGTERM -> SIGKILL window (sources named in the module docstring)
DELAY_S = 3.0  # the slowed save: seconds its writer thread waits before the commit


def _launch(tmp: Path, runs: list):
    job = {"out": str(tmp / "out.json"), "runs": runs}
    (tmp / "job.json").write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", CHILD]
    return _start(cmd + [str(tmp / "job.json")], tmp / "run.log")


@heavy
def test_damaged_shard_on_one_process_falls_back_everywhere_and_unshared_root_is_refused(tmp_path):
    ck, own = tmp_path / "ck", str(tmp_path / "own")
    runs = [
        {"name": "save", "steps": 6, "checkpoint_every": 2, "ckpt": str(ck)},
        {"name": "flip", "flip": str(ck / "step-00000006" / "__1_0.distcp")},
        # it saves step 6 again, over the damaged one (restore fell back past it: this run's to replace)
        {"name": "resume", "steps": 6, "checkpoint_every": 2, "resume": True, "ckpt": str(ck)},
        {"name": "unshared", "steps": 2, "checkpoint_every": 2, "ckpt": own, "per_rank_root": True},
    ]
    t0 = time.perf_counter()
    proc, log = _launch(tmp_path, runs)
    code, text = _wait(proc, log, 240)
    print(f"[fallback + unshared] {time.perf_counter() - t0:.1f} s")
    assert code == 0, text[-4000:]
    r = json.loads((tmp_path / "out.json").read_text())
    save, res, bad = r["save"], r["resume"], r["unshared"]
    assert "error" not in save and "error" not in res, (save, res)
    assert sorted(p.name for p in ck.glob("step-*")) == ["step-00000002", "step-00000004", "step-00000006"]
    assert res["restored"] == [4, 4] and res["first_step"] == 5, res  # every process: the same older step
    assert max(abs(a - b) for a, b in zip(res["global_losses"], save["global_losses"][4:])) < 1e-4, (res, save)
    assert len(res["global_losses"]) == 2, res
    said = " ".join(res["warnings"])
    assert "step-00000006/__1_0.distcp" in said and "on process" in said and "falling back" in said, said
    from labkit.checkpoint import CheckpointManager

    again = CheckpointManager(str(ck), rt=None).restore()  # the re-saved step 6 verifies and reads (one process)
    assert again is not None and again["step"] == 6, sorted(again or {})
    err = bad.get("error", "")
    assert "lacks __1_0.distcp" in err and "must be one place every host sees" in err, bad
    for r_ in (0, 1):  # no commit, under either folder
        assert not list(Path(f"{own}-{r_}").glob("step-*/COMMITTED")), r_


@heavy
def test_sigterm_to_torchrun_commits_the_save_within_its_window(tmp_path):
    from labkit.checkpoint import CheckpointManager

    ck, progress, steps = tmp_path / "ck", str(tmp_path / "progress"), 60
    run = {"name": "run", "steps": steps, "checkpoint_every": 1000, "ckpt": str(ck), "delay": DELAY_S}
    run.update(progress=progress, step_sleep=0.1)
    proc, log = _launch(tmp_path, [run])
    sent, deadline = None, time.monotonic() + 120
    while sent is None and proc.poll() is None and time.monotonic() < deadline:
        text = Path(f"{progress}.1").read_text() if Path(f"{progress}.1").exists() else ""
        if text and int(text.split()[1]) >= 2:
            sent = time.time()
            os.kill(proc.pid, signal.SIGTERM)  # torchrun, not a worker
        time.sleep(0.02)
    code, text = _wait(proc, log, 120)
    gone = time.time()
    assert sent is not None, text[-4000:]
    pids = [int(Path(f"{progress}.{r}").read_text().split()[0]) for r in (0, 1)]
    for pid in pids:  # every worker exited (torchrun waited for them; none is left behind)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert "SIGKILL" not in text, text[-4000:]  # nobody needed torchrun's kill
    report = json.loads((tmp_path / "out.json").read_text())["run"]
    assert "error" not in report, report
    stop = report["ends"][0][0]
    assert report["ends"] == [[stop, True], [stop, True]], report["ends"]
    saved = sorted(p.name for p in ck.iterdir() if p.name.startswith("step-"))
    assert saved == [f"step-{stop:08d}"], saved
    marker = json.loads((ck / saved[0] / "COMMITTED").read_text())
    committed_after = marker["time"] - sent
    t = {k: round(v - sent, 1) for k, v in report["times"].items()}
    print(
        f"[sigterm to torchrun] after the SIGTERM: training stopped {t['stopped']} s, committed "
        f"{committed_after:.1f} s, save closed {t['closed']} s, torchrun gone {gone - sent:.1f} s (window "
        f"{TORCHRUN_GRACE_S} s); training thread's save stall {report['stalls']} s"
    )
    assert DELAY_S <= committed_after < TORCHRUN_GRACE_S and gone - sent < TORCHRUN_GRACE_S
    assert max(report["stalls"]) < DELAY_S, report["stalls"]  # the slow part ran off the training thread
    state = CheckpointManager(str(ck), rt=None).restore()  # one process reads the 2 processes' shards back
    assert state is not None and state["step"] == stop, sorted(state)
