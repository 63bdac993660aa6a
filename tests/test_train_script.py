"""`python -m labkit.train`: flags map onto the notebooks' parameters, and one process, SPMD over 4 XLA:CPU
devices and torchrun DDP over 2 gloo ranks reach the same final loss.

Why the losses must agree: every mode trains on a global batch of 16 windows per step, and with
recipes.text_batches' shared order the windows of a step are the same whoever loads them (one process
draws 16; each torchrun rank draws the same 16 and keeps its 8; under SPMD one process loads 16 and XLA
shards them over 4 devices). DDP averages the two ranks' mean gradients, which is the mean gradient of
the 16 windows; the SPMD partitioner sums partial gradients across devices. So the updates differ only by
float reassociation (another summation order), and the final validation loss, a function of the weights
alone, drifts by rounding only. Measured over 20 AdamW steps (2026-11-23): single CPU 3.189851,
torchrun 2 x gloo 3.189863, SPMD 4 x XLA:CPU 3.189857, single XLA:CPU 3.189852 (spread 1.2e-5 nats).
TOL = 2e-4 nats leaves ~16x room for other rounding (another BLAS, AdamW dividing by small second
moments) and is ~20x below what a wrong split does: training on batches of 8 (a per-rank batch taken for
the global one) ended at 3.185971, 3.9e-3 away.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import train

ROOT = Path(__file__).resolve().parent.parent
TOL = 2e-4  # nats; derivation in the module docstring
GLOBAL_BATCH = 16
# fast mode, shortened: 20 steps of a 2-layer 64-wide GPT on 32-byte windows, one evaluation of 2 batches
ARGS = ["gpt", "--fast", "--max-steps", "20", "--evals", "1", "--eval-batches", "2", "--log-every", "10"]
ARGS += ["--block-size", "32"]


def _env(**extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT))
    for var in ("LABKIT_FAST", "RANK", "WORLD_SIZE", "LOCAL_RANK", "CPU_NUM_DEVICES", "LABKIT_BACKEND"):
        env.pop(var, None)
    env.update(extra)
    return env


def _final(cmd, env, timeout=300, cwd=ROOT) -> dict:
    """Run a training command; parse its FINAL line (printed once, by process 0)."""
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr[-4000:]
    assert p.returncode == 0, out
    finals = [line for line in p.stdout.splitlines() if line.startswith("FINAL ")]
    assert len(finals) == 1, f"expected one FINAL line (process 0 only):\n{out}"
    fields = dict(kv.split("=", 1) for kv in finals[0].split()[1:])
    return {k: float(v) if re.fullmatch(r"-?[\d.]+(e-?\d+)?", v) else v for k, v in fields.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def single():
    """The reference: one plain-CPU process, batch 16."""
    cmd = [sys.executable, "-m", "labkit.train", *ARGS, "--batch-size", str(GLOBAL_BATCH), "--backend", "cpu"]
    return _final(cmd, _env())


# -- flags and parameters ------------------------------------------------------------------------
def _notebook_params(name: str):
    """The notebook's Params class, executed from its source (the parameters cell defines it)."""
    tree = ast.parse((ROOT / "notebooks" / name).read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Params"]
    ns: dict = {}
    exec(compile(ast.Module(body=[cls], type_ignores=[]), name, "exec"), {"dataclasses": dataclasses}, ns)
    return ns["Params"]


@pytest.mark.parametrize(
    "notebook, cls", [("01_resnet50_cifar10.py", train.ResNetParams), ("02_transformer_lm.py", train.GPTParams)]
)
def test_script_parameters_are_the_notebooks(notebook, cls):
    nb = _notebook_params(notebook)
    assert [(f.name, f.type, f.default) for f in dataclasses.fields(nb)] == [
        (f.name, f.type, f.default) for f in dataclasses.fields(cls)
    ], f"{notebook}'s Params and labkit.train.{cls.__name__} differ"
    assert nb.FAST == cls.FAST, f"{notebook}'s FAST overlay and labkit.train.{cls.__name__}.FAST differ"


def test_flags_override_fast_and_environment(monkeypatch):
    monkeypatch.setenv("LABKIT_FAST", "0")  # --fast sets it to 1; monkeypatch restores it afterwards
    monkeypatch.setenv("LABKIT_LR", "0.5")
    args = train.parser().parse_args(["gpt", "--fast", "--batch-size", "3", "--spmd", "off"])
    P = train.params_from(args)
    assert (P.batch_size, P.spmd, P.lr, P.n_layer) == (3, "off", 0.5, train.GPTParams.FAST["n_layer"])
    args = train.parser().parse_args(["resnet", "--epochs", "2", "--cifar-stem", "false"])
    P = train.params_from(args)
    assert (P.epochs, P.cifar_stem, P.source) == (2, False, "digits")  # LABKIT_FAST=1, set by --fast above


def test_bad_flag_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        train.parser().parse_args(["resnet", "--cifar-stem", "maybe"])
    assert "--cifar-stem" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.parser().parse_args(["gpt", "--batch-sise", "8"])


# -- the three ways to run it -------------------------------------------------------------------
def test_single_process_learns(single):
    assert single["steps"] == 20 and single["samples"] == 20 * GLOBAL_BATCH and single["world"] == 1
    assert single["loss"] < 4.0, f"val loss {single['loss']}: no better than the first steps (ln 256 = 5.55)"


@pytest.mark.heavy  # two torchrun processes: the 3.13 run leaves them to the 3.11 run
def test_torchrun_ddp_two_ranks_matches_one_process(single):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}"]
    cmd += ["-m", "labkit.train", *ARGS, "--batch-size", str(GLOBAL_BATCH // 2)]
    ddp = _final(cmd, _env())  # no --backend: under torchrun without GPU or TPU labkit picks cpu + gloo
    print("single", single["loss"], "torchrun", ddp["loss"])
    assert ddp["world"] == 2 and ddp["samples"] == single["samples"], ddp
    assert abs(ddp["loss"] - single["loss"]) < TOL, (ddp["loss"], single["loss"])


def test_meta_init_flag_gives_the_plain_builds_losses(single):
    """--meta-init builds the model on the meta device; the plan gives it memory. One process: the losses of the
    plain build, to every printed digit."""
    cmd = [sys.executable, "-m", "labkit.train", *ARGS, "--batch-size", str(GLOBAL_BATCH), "--backend", "cpu"]
    meta = _final([*cmd, "--meta-init"], _env())
    assert (meta["loss"], meta["train_loss"]) == (single["loss"], single["train_loss"]), (meta, single)


@pytest.mark.heavy  # two torchrun processes: the 3.13 run leaves them to the 3.11 run
def test_meta_init_flag_under_fsdp2_gives_the_plain_builds_losses(single):
    """2 gloo processes under --parallel fsdp2 (about 22 CPU-seconds): with --meta-init each process fills only its
    shards, and the losses are the plain build's under fsdp2, to every printed digit."""
    got = {}
    for flag in ([], ["--meta-init"]):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}"]
        cmd += ["-m", "labkit.train", *ARGS, "--batch-size", str(GLOBAL_BATCH // 2), "--parallel", "fsdp2", *flag]
        got[bool(flag)] = _final(cmd, _env())
    meta, plain = got[True], got[False]
    assert meta["world"] == 2 and (meta["loss"], meta["train_loss"]) == (plain["loss"], plain["train_loss"]), got
    assert abs(meta["loss"] - single["loss"]) < TOL, (meta["loss"], single["loss"])


@pytest.mark.heavy  # ~100 s here: XLA:CPU compiles the partitioned graphs
def test_spmd_on_four_xla_cpu_devices_matches_one_process(single):
    cmd = [sys.executable, "-m", "labkit.train", *ARGS, "--batch-size", str(GLOBAL_BATCH // 4)]
    spmd = _final(cmd, _env(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4"))  # --spmd auto: on with 4 devices
    print("single", single["loss"], "spmd", spmd["loss"])
    assert spmd["chips"] == 4 and spmd["world"] == 1 and spmd["samples"] == single["samples"], spmd
    assert abs(spmd["loss"] - single["loss"]) < TOL, (spmd["loss"], single["loss"])


def test_shared_order_splits_one_draw_over_ranks():
    """What makes the modes comparable: ranks' rows put together are the one-process batch; without
    shared_order each rank draws windows of its own (the old per-replica behaviour, kept as default)."""
    import torch

    from data_tools.text import TextBatches

    data = torch.arange(1000) % 251
    one = list(TextBatches(data, 8, 16, 3, seed=5, shared_order=True))
    ranks = [list(TextBatches(data, 4, 16, 3, seed=5, rank=r, world_size=2, shared_order=True)) for r in (0, 1)]
    for step, (x, y) in enumerate(one):
        assert torch.equal(torch.cat([ranks[0][step][0], ranks[1][step][0]]), x)
        assert torch.equal(torch.cat([ranks[0][step][1], ranks[1][step][1]]), y)
    assert torch.equal(one[0][0], next(iter(TextBatches(data, 8, 16, 3, seed=5)))[0])  # one replica: unchanged
    own = next(iter(TextBatches(data, 4, 16, 3, seed=5, rank=1, world_size=2)))[0]
    assert not torch.equal(own, ranks[1][0][0])


@pytest.mark.heavy  # ResNet-50 on the plain CPU: ~1.5 min of CPU, several minutes on a loaded machine
def test_resnet_recipe_trains_writes_shards_and_a_checkpoint(tmp_path):
    """Notebook 01's path as a script: digits shards and the checkpoint on a loopback GCS server (fast mode)."""
    cmd = [sys.executable, "-m", "labkit.train", "resnet", "--fast", "--backend", "cpu", "--max-steps", "3"]
    cmd += ["--log-every", "3", "--samples-per-shard", "100"]
    final = _final(cmd, _env(), timeout=900, cwd=tmp_path)
    assert final["steps"] == 3 and final["samples"] == 3 * train.ResNetParams.FAST["batch_size"], final
    assert final["source"] == "digits" and final["loss"] < 10, final
    assert list(tmp_path.glob("data/local-gcs/**/checkpoints-resnet50/run-*/*")), "no checkpoint on the GCS server"


def test_torchrun_on_a_cpu_host_picks_the_plain_cpu(monkeypatch):
    """torchrun sets WORLD_SIZE in every rank; XLA:CPU has no multi-process path, so auto-detection says cpu."""
    import torch

    from labkit import device

    if torch.cuda.is_available() or device.tpu_evidence():
        pytest.skip("a GPU or TPU host: torchrun would use it")
    monkeypatch.delenv("LABKIT_BACKEND", raising=False)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert device.resolve_backend() == "cpu"
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(device.BackendError, match="WORLD_SIZE='two'"):
        device.resolve_backend()


def test_sigterm_stops_the_script_with_one_line_and_exit_143(tmp_path):
    """A preempted host's SIGTERM: the script stops what it started and exits 143 (128 + 15) with one line naming
    it, not a traceback (a scheduler reads the code; a person reads the line)."""
    import signal
    import time

    log = tmp_path / "out"
    with open(log, "w") as out:
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "labkit.train",
                "gpt",
                "--fast",
                "--max-steps",
                "100000",
                "--log-every",
                "5",
                "--backend",
                "cpu",
            ],
            cwd=ROOT,
            env=_env(LABKIT_FAST="1", PYTHONUNBUFFERED="1"),
            stdout=out,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.time() + 120
        while not re.search(r"^step +\d", log.read_text(), re.M) and p.poll() is None and time.time() < deadline:
            time.sleep(0.2)  # training has begun once a step is logged ("step     10  epoch 0  loss ...")
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    assert p.returncode == 143, f"rc={p.returncode}\n{log.read_text()[-2000:]}\n{err[-2000:]}"
    assert "[labkit.train] Preempted: SIGTERM" in err and "Traceback" not in err, err[-2000:]
