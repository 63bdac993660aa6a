"""SPMD data parallelism over 4 virtual CPU devices, each case in a subprocess: SPMD must be switched
on before the first XLA tensor exists, and this test process already has some."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import background, test_images
from tests.children.image_job import load_image_venv

# heavy: minutes of XLA:CPU compiles or real child processes; the Python 3.13 run leaves them to the 3.11 run
pytestmark = pytest.mark.heavy

ROOT = Path(__file__).resolve().parent.parent
image_venv = load_image_venv()


def _env(**extra):
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


def test_spmd_data_parallel_trains_with_sharded_inputs():
    p = subprocess.run(
        [sys.executable, "-m", "tests.children.spmd_train"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = p.stdout + p.stderr[-3000:]
    assert p.returncode == 0, out
    assert "SHARDING {devices=[4,1]0,1,2,3}" in p.stdout, out


def test_setup_auto_switches_spmd_on_with_several_devices_and_off_with_one():
    code = (
        "import labkit, torch_xla.runtime as xr; rt = labkit.setup('xla-cpu', spmd='auto'); "
        "print('SPMD', rt.spmd, xr.is_spmd(), rt.local_device_count, labkit.spmd.mesh.batch_plan(rt, 8).global_batch)"
    )
    many = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert "SPMD True True 4 32" in many.stdout, many.stdout + many.stderr[-2000:]
    one = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=_env(CPU_NUM_DEVICES="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "SPMD False False 1 8" in one.stdout, one.stdout + one.stderr[-2000:]


# Notebooks 01 and 02 in fast mode on several virtual devices run once, in the Kaggle TPU image (a v5e-8: its header's
# `# devices:` line, the per-chip batch in tests/children/image_job.py MULTI_DEVICE_ENV), beside the suite in the
# background; this test reads those runs. Their own asserts (loss falls, exact sample counts in evaluation, no
# recompilation after warm-up, the resume) must hold under SPMD too, and tests/test_images.py fails if a cell fails.
# What notebook 01 prints when it applies the lr rule (the lr rounded as the notebook prints it):
LR_LINE = "global batch 32, lr 0.000707107 -> 0.001 by the sqrt rule"
NOTEBOOKS = ("01_resnet50_cifar10", "02_transformer_lm")


def _image_for(stem: str) -> tuple[str, int]:
    """The image that runs notebook `stem` on several devices, and how many."""
    for name in image_venv.image_names():
        n = image_venv.load(name).devices.get(stem[:2], 1)
        if n > 1:
            return name, n
    raise LookupError(f"no image under images/ runs {stem} on several devices (its '# devices:' header line)")


def background_job(item) -> background.Job | None:
    if item.originalname != "test_notebook_trains_on_every_device_with_spmd":
        return None
    return test_images.job(_image_for(item.callspec.params["name"])[0])


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_trains_on_every_device_with_spmd(name):
    image, devices = _image_for(name)
    job = background.wait(f"image-{image}", test_images.job(image))
    result = Path(job.argv[-1])
    assert job.returncode == 0 and result.exists(), f"the image job failed:\n{background.output(job)[-6000:]}"
    run = json.loads(result.read_text())["runs"].get(name)
    assert run is not None, f"{image} did not run {name}"
    out = f"{name} in {image} on {run['devices']} devices:\n{(run['error'] or '')[-3000:]}\n{run['printed'][-6000:]}"
    assert run["devices"] == devices and not run["error"], out
    printed = run["printed"]
    assert f"over {devices} chip(s)" in printed and f"SPMD over {devices} device(s) per host" in printed, out
    assert "recompilations after warm-up: 0" in printed, out
    if name.startswith("01"):  # the learning-rate rule applied, and said, when the chips multiply the batch
        assert LR_LINE in printed, out
