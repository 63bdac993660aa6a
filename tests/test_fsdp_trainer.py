"""The Trainer past one process: TrainConfig.parallel (labkit.parallel) under torchrun on gloo, a tiny GPT.

Child runs (tests/children/fsdp_trainer.py under `python -m torch.distributed.run`), each a few steps:
- accumulation: k = 4 micro-batches per optimizer step issue the collectives of k = 1, counted (DDP: the same
  all-reduces; FSDP2: the same all-gathers and reduce-scatters, the weights kept gathered through the window) and
  train as the 4-times larger batch: every logged loss within LOSS_TOL.
- sharded checkpoints: FSDP2 on 4 processes saves through DCP at step 3 (each process its own shards, a COMMITTED
  marker last) to a local folder, 2 processes resume it (and 2 -> 4 the other way, through gs:// on the loopback GCS
  server), and the resumed steps' losses equal an
  uninterrupted run's within LOSS_TOL, starting at the exact next step; another model's checkpoint is refused by name.
- SIGTERM to one of 2 processes: both stop after the same step, saved once (DCP, both writing), and a resume
  continues at the next step.
- two torchrun launches (--nnodes 2 --nproc-per-node 2, c10d rendezvous on 127.0.0.1) train `labkit.train gpt
  --parallel fsdp2` together, as two hosts would.

LOSS_TOL = 1e-4 nats: the runs compared differ only in where sums are split (a reduce-scatter over 4 or 2 processes,
4 micro-batches added in .grad or one batch's mean): float32 reassociation, measured ~5e-7 after 3 AdamW steps; a
position one batch off, or a lost optimizer state, moves the loss by > 1e-2 here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import labkit
from labkit import parallel
from labkit.precision import Precision
from labkit.runtime import Runtime

# heavy: the tests that start real torchrun child processes; the Python 3.13 run leaves them to the 3.11 run
heavy = pytest.mark.heavy

ROOT = Path(__file__).resolve().parent.parent
CHILD = str(ROOT / "tests" / "children" / "fsdp_trainer.py")
LOSS_TOL = 1e-4  # nats; derivation in the module docstring
NO_SAVE = {"checkpoint_every": 10**6}  # reads a checkpoint, saves none (0 would save at the epoch end)
BIG = {"n_embd": 512, "n_layer": 4}  # 12.9 M weights (labkit.lessons.fsdp_trainer.gpt_config)
TIMES: dict[str, float] = {}


def _env():
    # MALLOC_MMAP_THRESHOLD_: blocks above 128 KB come from mmap and go back to the system when freed, so the peak
    # RSS of one run's build (build_mb) is not hidden in memory an earlier run freed but glibc kept
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="3")
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    for var in (
        "LABKIT_FAST",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "CPU_NUM_DEVICES",
        "LABKIT_BACKEND",
        "LABKIT_PARALLEL",
    ):
        env.pop(var, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd, log_path, cwd=ROOT, env=None):
    log = open(log_path, "w+")
    env = {**_env(), **(env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def _wait(proc, log, timeout):
    """The exit code and the log's text; the whole process group (torchrun's workers too) killed on a timeout."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = "timed out"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.seek(0)
    text = log.read()
    log.close()
    return code, text


def _torchrun_hosts(tmp: Path, name: str, runs: list, timeout: float = 240) -> dict:
    """Two torchrun launches of 2 processes each, joined by the c10d rendezvous on 127.0.0.1, as two hosts would
    (LOCAL_WORLD_SIZE 2, WORLD_SIZE 4); process 0's report."""
    job = {"out": str(tmp / f"{name}.json"), "runs": runs}
    (tmp / f"{name}-job.json").write_text(json.dumps(job))
    base = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d"]
    base += [
        f"--rdzv-endpoint=127.0.0.1:{_free_port()}",
        f"--rdzv-id=labkit-{name}",
        CHILD,
        str(tmp / f"{name}-job.json"),
    ]
    t0 = time.perf_counter()
    hosts = [_start(base, tmp / f"{name}-host{i}.log") for i in range(2)]
    results = [_wait(p, log, timeout) for p, log in hosts]
    TIMES[name] = round(time.perf_counter() - t0, 1)
    for code, text in results:
        assert code == 0 and os.path.exists(job["out"]), f"{name} exit {code}:\n{text[-4000:]}"
    return json.loads(Path(job["out"]).read_text())


def _torchrun(tmp: Path, name: str, nproc: int, runs: list, timeout: float = 240) -> dict:
    job = {"out": str(tmp / f"{name}.json"), "runs": runs}
    (tmp / f"{name}-job.json").write_text(json.dumps(job))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    t0 = time.perf_counter()
    proc, log = _start(cmd + [CHILD, str(tmp / f"{name}-job.json")], tmp / f"{name}.log")
    code, text = _wait(proc, log, timeout)
    TIMES[name] = round(time.perf_counter() - t0, 1)
    assert code == 0 and os.path.exists(job["out"]), f"{name} exit {code}:\n{text[-4000:]}"
    report = json.loads(Path(job["out"]).read_text())
    print(f"[{name}] {TIMES[name]} s", {k: {a: b for a, b in v.items() if a != "trace"} for k, v in report.items()})
    return report


# -- the plan, without processes ------------------------------------------------------------------------------
def test_parallel_setting_is_checked_and_read_from_the_environment(monkeypatch):
    with pytest.raises(ValueError, match=r"TrainConfig.parallel='zero3'"):
        labkit.TrainConfig(parallel="zero3")
    monkeypatch.setenv("LABKIT_PARALLEL", "fsdp2")
    assert labkit.TrainConfig.from_env().parallel == "fsdp2"
    from labkit import train

    args = train.parser().parse_args(["gpt", "--parallel", "fsdp2"])
    assert args.parallel == "fsdp2"


def test_fsdp_accumulate_is_a_flag_of_the_recipe_that_accumulates(monkeypatch, capsys):
    """`python -m labkit.train resnet --fsdp-accumulate MODE` reaches the run's TrainConfig; else
    LABKIT_FSDP_ACCUMULATE, else auto; a mode FullyShard lacks is refused naming the flag or the variable. The gpt
    recipe does not accumulate: no such flag there."""
    from labkit import train

    seen = {}
    monkeypatch.setattr(train, "run_resnet", lambda P, **kw: seen.update(kw) or {})
    train.main(["resnet", "--fsdp-accumulate", "sharded", "--accum-steps", "2"])
    assert seen["fsdp_accumulate"] == "sharded"
    P = train.params_from(train.parser().parse_args(["resnet", "--accum-steps", "2"]))
    assert train.resnet_config(P, 10, fsdp_accumulate=seen["fsdp_accumulate"]).fsdp_accumulate == "sharded"
    assert train.resnet_config(P, 10).fsdp_accumulate == "auto"
    monkeypatch.setenv("LABKIT_FSDP_ACCUMULATE", "gathered")
    assert train.resnet_config(P, 10).fsdp_accumulate == "gathered"
    monkeypatch.setenv("LABKIT_FSDP_ACCUMULATE", "shraded")
    with pytest.raises(ValueError, match="LABKIT_FSDP_ACCUMULATE='shraded'"):
        train.resnet_config(P, 10)
    for argv in (["resnet", "--fsdp-accumulate", "shraded"], ["gpt", "--fsdp-accumulate", "sharded"]):
        with pytest.raises(SystemExit):
            train.parser().parse_args(argv)
    assert "--fsdp-accumulate" in capsys.readouterr().err


def test_auto_picks_by_bytes_per_device():
    gib = 2**30
    # 16 bytes a weight (weight, gradient, AdamW's two moments) against half of the device
    assert parallel.auto_plan(1_000_000_000, 80 * gib, 8) == "replicate"  # 16 GB <= 40 GiB
    assert parallel.auto_plan(7_000_000_000, 80 * gib, 8) == "fsdp2"  # 112 GB > 40 GiB
    assert parallel.auto_plan(7_000_000_000, None, 8) == "replicate"  # unknown memory: nothing is sharded
    rt = Runtime("cpu", torch.device("cpu"), 4, 0, 0, 1, False, {})
    from labkit.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=32))
    assert type(parallel.choose(rt, "auto", None, model)) is parallel.Replicate  # ~140 kB on a host of GBs
    assert type(parallel.choose(rt, "fsdp2")) is parallel.FullyShard
    assert [type(u).__name__ for u in parallel.units(model)] == ["Block", "Block"]
    import torchvision

    blocks = parallel.units(torchvision.models.resnet50())  # its bottleneck blocks, not its four stages
    assert len(blocks) == 16 and all(type(b).__name__ == "Bottleneck" for b in blocks)
    # several hosts: hsdp where a host's share fits half the device and a whole copy does not
    assert parallel.auto_plan(7_000_000_000, 80 * gib, 16, hosts=2) == "hsdp"  # 112 GB / 8 = 14 GB fits
    assert parallel.auto_plan(3_000_000_000, 80 * gib, 16, hosts=2) == "hsdp"  # 48 GB > 40 GiB; / 8 = 6 GB fits
    assert parallel.auto_plan(30_000_000_000, 80 * gib, 16, hosts=2) == "fsdp2"  # 480 GB / 8 = 60 GB > 40 GiB


def test_a_plan_the_world_cannot_use_is_refused_by_name():
    one = Runtime("cpu", torch.device("cpu"), 1, 0, 0, 1, False, {})
    assert type(parallel.choose(one, "auto")) is parallel.Single
    for setting in ("fsdp2", "replicate"):
        with pytest.raises(
            ValueError, match=rf"parallel='{setting}' needs torchrun with 2 or more processes.*world size 1"
        ):
            parallel.choose(one, setting)
    four = Runtime("cpu", torch.device("cpu"), 4, 0, 0, 1, False, {})
    with pytest.raises(ValueError, match=r"parallel='fsdp2' with fp16"):
        parallel.choose(four, "fsdp2", Precision("fp16", "cuda", "test"))


# -- under torchrun -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory, gcs_server):
    """Five torchrun launches: 4 processes (accumulation, the reference, a save at step 3 to a local folder), 1
    process (a one-file save; the 4-process checkpoint resumed whole), 2 hosts x 2 processes (HSDP), 2 processes
    (meta-device builds, resume 4 -> 2, another model refused, a save at step 3 to gs:// on the loopback GCS server,
    the one-file and the HSDP checkpoints resumed), 4 processes (resume 2 -> 4 from gs://)."""
    from labkit.cloud import gcs

    tmp = tmp_path_factory.mktemp("fsdp")
    bucket = f"fsdp-{os.getpid()}"
    gcs.client().create_bucket(bucket)  # the children reach the server through STORAGE_EMULATOR_HOST
    ck4, ck2, ck1 = str(tmp / "ck4"), f"gs://{bucket}/ck2", str(tmp / "ck1")
    four = _torchrun(
        tmp,
        "four",
        4,
        [
            {"name": "ddp_k1", "parallel": "replicate", "accum_steps": 4, "merge": True, "steps": 3, "count": True},
            {"name": "ddp_k4", "parallel": "replicate", "accum_steps": 4, "steps": 3, "count": True},
            {"name": "fsdp_k1", "parallel": "fsdp2", "accum_steps": 4, "merge": True, "steps": 3, "count": True},
            {"name": "fsdp_k4", "parallel": "fsdp2", "accum_steps": 4, "steps": 3, "count": True},
            {
                "name": "fsdp_k4_sharded",
                "parallel": "fsdp2",
                "accum_steps": 4,
                "steps": 3,
                "count": True,
                "fsdp_accumulate": "sharded",
            },
            {"name": "ref", "parallel": "fsdp2", "steps": 6},
            {"name": "save", "parallel": "fsdp2", "steps": 6, "stop_at": 3, "checkpoint_every": 3, "ckpt": ck4},
        ],
    )
    # one process (no process group): a one-file checkpoint at step 3, the format of a notebook's run; and the
    # 4-process DCP checkpoint (DTensor shards, optimizer state by name) resumed whole, saving nothing there
    one = _torchrun(
        tmp,
        "one",
        1,
        [
            {"name": "save", "parallel": "auto", "steps": 6, "stop_at": 3, "checkpoint_every": 3, "ckpt": ck1},
            {"name": "to_one", "parallel": "auto", "steps": 6, "resume": True, "ckpt": ck4, **NO_SAVE},
        ],
    )
    # HSDP: 2 simulated hosts x 2 processes (two torchrun launches), resumed below on 1 host x 2 (DCP reshards)
    ckh = str(tmp / "ckh")
    hsdp = _torchrun_hosts(
        tmp,
        "hsdp",
        [
            # k = 2 as one merged batch, then accumulated sharded: the all-reduce across hosts once per step in both
            {"name": "count", "parallel": "hsdp", "accum_steps": 2, "merge": True, "steps": 3, "count": True},
            {
                "name": "count_k2",
                "parallel": "hsdp",
                "accum_steps": 2,
                "steps": 3,
                "count": True,
                "fsdp_accumulate": "sharded",
            },
            {"name": "save", "parallel": "hsdp", "steps": 6, "stop_at": 3, "checkpoint_every": 3, "ckpt": ckh},
        ],
    )
    two = _torchrun(
        tmp,
        "two",
        2,
        [
            # a GPT of 12.9 M weights: its training state (16 B a weight, 206 MB) exceeds half of a 300 MB budget, so
            # "auto" refuses replicate; built on the meta device first (its build's memory measured before any other
            # run's), then the ordinary way
            {"name": "big_meta", "parallel": "auto", "meta": True, "budget_mb": 300, "steps": 2, **BIG},
            {"name": "big_plain", "parallel": "fsdp2", "steps": 2, **BIG},
            {"name": "meta", "parallel": "fsdp2", "meta": True, "steps": 6},
            {"name": "resume", "parallel": "fsdp2", "steps": 6, "resume": True, "ckpt": ck4},
            {"name": "other_model", "parallel": "fsdp2", "steps": 6, "resume": True, "ckpt": ck4, "n_embd": 48},
            {"name": "save", "parallel": "fsdp2", "steps": 6, "stop_at": 3, "checkpoint_every": 3, "ckpt": ck2},
            {"name": "from_one", "parallel": "fsdp2", "steps": 6, "resume": True, "ckpt": ck1},
            {"name": "from_hsdp", "parallel": "fsdp2", "steps": 6, "resume": True, "ckpt": ckh},
        ],
    )
    back = _torchrun(tmp, "back", 4, [{"name": "resume", "parallel": "fsdp2", "steps": 6, "resume": True, "ckpt": ck2}])
    return {"one": one, "four": four, "hsdp": hsdp, "two": two, "back": back, "ck4": ck4, "ck2": ck2}


def _close(a, b, tol=LOSS_TOL):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


@heavy
def test_fsdp2_shards_every_parameter_and_keeps_plain_names(runs):
    r = runs["four"]
    f, d = r["fsdp_k1"], r["ddp_k1"]
    assert "error" not in f and "error" not in d, (f, d)
    assert f["plan"].startswith("fsdp2 over 4") and d["plan"].startswith("replicate (DDP) over 4")
    assert f["placements"] == ["S(0)"] and d["placements"] == ["plain tensor"]
    assert f["keys"] == d["keys"] and f["keys"][0].startswith("blocks.0.")  # no FSDP prefix in the state's names
    assert f["full_param_bytes"] == d["param_bytes"] and f["param_bytes"] <= d["param_bytes"] // 4 + 4096  # padding
    assert f["opt_bytes"] == 2 * f["param_bytes"]
    assert _close(f["losses"], d["losses"]) and f["losses"][-1] < f["losses"][0] - 0.5, (f["losses"], d["losses"])


@heavy
def test_accumulation_reduces_once_per_optimizer_step(runs):
    r = runs["four"]
    for plan, reduce_op in (("ddp", "all-reduce"), ("fsdp", "reduce-scatter")):
        k1, k4 = r[f"{plan}_k1"], r[f"{plan}_k4"]
        assert "error" not in k4, k4
        assert k4["comm"][reduce_op] == k1["comm"][reduce_op] > 0, (plan, k1["comm"], k4["comm"])
        assert _close(k4["losses"], k1["losses"]), (plan, k1["losses"], k4["losses"])
    assert r["ddp_k4"]["comm"] == r["ddp_k1"]["comm"]  # DDP: nothing else runs per micro-batch
    # FSDP2: 2 layers -> the root once, each block in forward, the first block again in backward (the last stays
    # gathered after its forward: 5 before that policy), 4 all-gathers; L + 1 reduce-scatters; one all-reduce of the
    # gradient norm's partial sums (clip_norm=1.0) per optimizer step. At k = 4 the weights stay gathered through the
    # window: the first forward gathers, the last backward gathers again, the same 4 (16 if each micro-batch gathered)
    assert r["fsdp_k1"]["comm"] == {"all-gather": 4, "reduce-scatter": 3, "all-reduce": 1}
    assert r["fsdp_k4"]["comm"] == r["fsdp_k1"]["comm"]
    for op in ("all-gather", "reduce-scatter"):
        assert r["fsdp_k4"]["comm_bytes"][op] == r["fsdp_k1"]["comm_bytes"][op], (op, r["fsdp_k4"]["comm_bytes"])


@heavy
def test_dcp_checkpoint_resumes_on_another_number_of_processes(runs):
    ref = runs["four"]["ref"]["global_losses"]  # the mean over the processes: the same whatever their number
    assert len(ref) == 6
    from labkit.cloud import open_store

    for ck, n in ((runs["ck4"], 4), (runs["ck2"], 2)):  # a local folder, gs:// (the same store layer)
        store = open_store(ck)
        marker = json.loads(store.get("step-00000003/COMMITTED"))
        shards = sorted(f for f in marker["files"] if f.endswith(".distcp"))
        assert marker["processes"] == n and len(shards) == n and ".metadata" in marker["files"], marker
        stored = sorted(name.split("/", 1)[1] for name in store.list("step-00000003/"))
        assert stored == sorted([*marker["files"], "COMMITTED"]), (ck, stored)
    assert _close(runs["four"]["save"]["global_losses"], ref[:3]) and _close(
        runs["two"]["save"]["global_losses"], ref[:3]
    )
    for name, res in (("4 -> 2", runs["two"]["resume"]), ("2 -> 4", runs["back"]["resume"])):
        assert "error" not in res, res
        assert res["first_step"] == 4, (name, res)  # the data position: the step after the checkpoint's
        assert _close(res["global_losses"], ref[3:]), (name, res["global_losses"], ref[3:])
        print(name, "largest loss difference", max(abs(a - b) for a, b in zip(res["global_losses"], ref[3:])))


@heavy
def test_one_file_checkpoint_resumes_under_fsdp2_and_back(runs):
    """A one-process run's one-file checkpoint (whole tensors, optimizer state by position) resumes under fsdp2 on 2
    processes, its state split into their shards; a 4-process DCP checkpoint resumes in one process. Both continue
    at step 4 with the losses of an uninterrupted run."""
    ref = runs["four"]["ref"]["global_losses"]
    one, from_one, to_one = runs["one"]["save"], runs["two"]["from_one"], runs["one"]["to_one"]
    assert "error" not in one and "error" not in from_one and "error" not in to_one, (one, from_one, to_one)
    assert _close(one["global_losses"], ref[:3])  # the one-process run is the same run
    assert from_one["first_step"] == 4 and to_one["first_step"] == 4
    assert from_one["plan"].startswith("fsdp2 over 2") and to_one["plan"] == "single"
    assert _close(from_one["global_losses"], ref[3:]), (from_one["global_losses"], ref[3:])
    assert _close(to_one["global_losses"], ref[3:]), (to_one["global_losses"], ref[3:])


@heavy
def test_meta_device_build_trains_as_the_ordinary_build(runs):
    """labkit.meta_init: built on the meta device, sharded, each shard filled as a one-process build fills it: the
    same losses as the 4-process run of an ordinarily built model."""
    meta, ref = runs["two"]["meta"], runs["four"]["ref"]
    assert "error" not in meta, meta
    assert _close(meta["global_losses"], ref["global_losses"]), (meta["global_losses"], ref["global_losses"])


@heavy
def test_a_model_whose_state_exceeds_the_budget_trains_under_fsdp2_built_on_meta(runs):
    """12.9 M weights, 206 MB of training state against half of a 300 MB budget: "auto" picks fsdp2 over replicate;
    the meta build's peak memory is the process's shards plus one tensor, the ordinary build's a whole copy first."""
    m, p = runs["two"]["big_meta"], runs["two"]["big_plain"]
    assert "error" not in m and "error" not in p, (m, p)
    assert m["plan"].startswith("fsdp2 over 2"), m["plan"]  # auto: replicate refused by the arithmetic
    from labkit.parallel import auto_plan

    weights = m["full_param_bytes"] // 4
    assert auto_plan(weights, 300 * 2**20, 2) == "fsdp2" and auto_plan(weights, 10 * 2**30, 2) == "replicate"
    assert _close(m["losses"], p["losses"]), (m["losses"], p["losses"])
    whole = m["full_param_bytes"] / 2**20  # 49 MB of float32 weights
    print(f"[build] peak RSS above the start: meta {m['build_mb']} MB, ordinary {p['build_mb']} MB (whole {whole:.0f})")
    assert m["build_mb"] < 0.75 * p["build_mb"] and p["build_mb"] > 0.9 * whole, (m["build_mb"], p["build_mb"])


@heavy
def test_accumulation_sharded_reduces_every_micro_batch_with_equal_losses(runs):
    r = runs["four"]
    k1, gathered, sharded = r["fsdp_k1"], r["fsdp_k4"], r["fsdp_k4_sharded"]
    assert "error" not in sharded, sharded
    assert "accumulation sharded (asked for)" in sharded["plan"] and "accumulation gathered" in gathered["plan"]
    assert _close(sharded["losses"], k1["losses"]), (k1["losses"], sharded["losses"])
    # every micro-batch is k = 1's step: 4x its all-gathers and reduce-scatters; the norm's all-reduce once per step
    for op in ("all-gather", "reduce-scatter"):
        assert sharded["comm"][op] == 4 * k1["comm"][op], (op, k1["comm"], sharded["comm"])
    assert sharded["param_bytes"] == gathered["param_bytes"]


@heavy
def test_hsdp_over_two_hosts_counts_per_dimension_and_resumes_on_one(runs):
    """2 hosts x 2 processes: all-gathers and reduce-scatters inside a host ("shard"), one all-reduce per gradient
    shard across hosts ("replicate"), whose bytes are each process's float32 gradient shard; the losses of the flat
    run; resumed by 2 processes of one host at step 4 with the uninterrupted run's losses."""
    count, save, back = runs["hsdp"]["count"], runs["hsdp"]["save"], runs["two"]["from_hsdp"]
    ref = runs["four"]["ref"]["global_losses"]
    assert "error" not in count and "error" not in save and "error" not in back, (count, save, back)
    assert count["plan"].startswith("hsdp over 2 hosts x 2 processes"), count["plan"]
    dims = count["comm_by_dim"]
    # inside a host: the gathers, the reduce-scatters and the gradient norm's 4-byte partial sums (clip_norm=1.0)
    assert set(dims["shard"]) == {"all-gather", "reduce-scatter", "all-reduce"}, dims
    assert dims["shard"]["all-reduce"] == [1, 4] and set(dims["replicate"]) == {"all-reduce"}, dims
    assert dims["replicate"]["all-reduce"][0] == dims["shard"]["reduce-scatter"][0], dims  # each shard, once
    shard_bytes = count["full_param_bytes"] / 2  # each process's gradient shard (float32, 2 processes a host)
    crossed = dims["replicate"]["all-reduce"][1]
    assert abs(crossed - shard_bytes) <= 0.02 * shard_bytes, (crossed, shard_bytes)  # FSDP2 pads dim 0 to 2
    assert _close(save["global_losses"], ref[:3]) and back["first_step"] == 4
    assert _close(back["global_losses"], ref[3:]), (back["global_losses"], ref[3:])


@heavy
def test_hsdp_sharded_accumulation_crosses_hosts_once_per_step(runs):
    """2 hosts x 2 processes, k = 2 accumulated sharded: each micro-batch reduce-scatters inside its host, and the
    all-reduce of those gradient shards across hosts runs once per optimizer step (set_requires_all_reduce(False)
    before the last micro-batch), its bytes one gradient shard, as the merged k = 1 batch's; the same losses."""
    k1, k2 = runs["hsdp"]["count"], runs["hsdp"]["count_k2"]
    assert "error" not in k2, k2
    assert "accumulation sharded (asked for)" in k2["plan"], k2["plan"]
    d1, d2 = k1["comm_by_dim"], k2["comm_by_dim"]
    assert d2["replicate"] == d1["replicate"], (d1, d2)  # [count, bytes] per step: 2x each before
    assert d2["shard"]["reduce-scatter"][0] == 2 * d1["shard"]["reduce-scatter"][0], (d1, d2)
    assert d2["shard"]["all-gather"][0] == 2 * d1["shard"]["all-gather"][0], (d1, d2)
    assert _close(k2["losses"], k1["losses"]), (k1["losses"], k2["losses"])


@heavy
def test_another_models_checkpoint_is_refused_by_name(runs):
    err = runs["two"]["other_model"].get("error", "")
    assert "blocks.0" in err or "wte.weight" in err, runs["two"]["other_model"]
    assert "shape" in err.lower() or "size" in err.lower(), err


@heavy
def test_two_hosts_by_c10d_rendezvous(tmp_path):
    """Two torchrun launches of 2 processes each, joined by the c10d rendezvous on 127.0.0.1: `python -m labkit.train`
    with --parallel auto across two hosts picks HSDP where a whole copy does not fit."""
    port = _free_port()
    base = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2"]
    base += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=labkit-fsdp-test"]
    args = ["-m", "labkit.train", "gpt", "--fast", "--parallel", "auto", "--max-steps", "4", "--evals", "1"]
    args += ["--eval-batches", "1", "--log-every", "2", "--block-size", "32", "--batch-size", "4", "--backend", "cpu"]
    t0 = time.perf_counter()
    # a 3 MB budget a process: the fast GPT's whole training state (118,528 weights x 16 B, 1.8 MB) does not fit half
    # of it, a host's half of that state does: "auto" picks hsdp (sharded within each launch, replicated across them)
    hosts = [_start(base + args, tmp_path / f"host{i}.log", env={"LABKIT_MEMORY_MB": "3"}) for i in range(2)]
    try:
        results = [_wait(p, log, 240) for p, log in hosts]
    finally:
        for p, _ in hosts:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    TIMES["two_hosts"] = round(time.perf_counter() - t0, 1)
    for code, text in results:
        assert code == 0, text[-4000:]
    finals = [line for _, text in results for line in text.splitlines() if line.startswith("FINAL ")]
    assert len(finals) == 1 and "world=4" in finals[0] and "steps=4" in finals[0], finals
    assert any("hsdp over 2 hosts x 2 processes" in text for _, text in results), results[0][1][-3000:]
    print(f"[two hosts] {TIMES['two_hosts']} s", finals[0])


@heavy
def test_sigterm_to_one_process_stops_all_at_one_step_saved_once(tmp_path):
    """SIGTERM to process 1 alone (what a preempted host's process gets; it signals itself after step 2, sigterm_at,
    so no PID read from a file is signalled): both processes agree on it at that step boundary, save that step
    together (one DCP checkpoint) and stop there. A second run in the same launch (fresh model, optimizer and
    Trainer: one launch instead of two, ~20 s less) resumes it and continues at the next step."""
    ck, progress, steps, at = str(tmp_path / "ck"), str(tmp_path / "progress"), 8, 2
    run = {"name": "run", "parallel": "fsdp2", "steps": steps, "ckpt": ck, "progress": progress, "sigterm_at": [1, at]}
    # stop_at: it stops before the epoch's end, so that it saves nothing of its own
    resumed = {"name": "resumed", "parallel": "fsdp2", "steps": steps, "stop_at": steps - 1, "ckpt": ck, "resume": True}
    report = _torchrun(tmp_path, "sigterm", 2, [run, resumed], timeout=120)
    assert "error" not in report["run"] and "error" not in report["resumed"], report
    ends = report["run"]["ends"]
    assert ends == [[at, True], [at, True]], ends  # the step it came after, on both processes
    saved = sorted(name for name in os.listdir(ck) if name.startswith("step-"))
    assert saved == [f"step-{at:08d}"], saved  # exactly one checkpoint: the step they stopped at
    marker = json.loads((Path(ck) / saved[0] / "COMMITTED").read_text())
    assert marker["processes"] == 2 and len([f for f in marker["files"] if f.endswith(".distcp")]) == 2, marker
    res = report["resumed"]
    assert res["first_step"] == at + 1 and len(res["losses"]) == steps - 1 - at, res  # on from the saved step
    print(f"[sigterm] {TIMES['sigterm']} s: signalled after step {at}, both stopped there")
