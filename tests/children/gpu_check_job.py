"""Child process of tests/test_gpu_check.py (run in the background, tests/background.py).

    python tests/children/gpu_check_job.py dry OUT_DIR           # the dry run of scripts/gpu_check.sh
    python tests/children/gpu_check_job.py instruments OUT_DIR   # tests/test_compile_instruments.py under torch 2.11

Builds or reuses the device venv (.venvs/nvidia-cuda/, images/device/nvidia-cuda.txt), prepares and checks the carried
wheels (scripts/gpu_wheels.py), runs scripts/gpu_check.sh with GPU_CHECK_DRY=1 in that venv, its $OUT in OUT_DIR/OUT;
writes OUT_DIR/job.json, the logs beside it. The test asserts on them.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.children.image_job import load_image_venv  # noqa: E402


def instruments_tests(img, site: Path) -> dict:
    """The compiled engine's instruments' tests (they read torch.compile's graph-break and recompile records) under
    this venv's torch 2.11, the Colab GPU image's and the device's, beside the main suite's torch 2.9: a change in
    torch's record format fails here. The image's pytest has no pytest-timeout: the project's addopts are replaced."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LABKIT_", "PYTHON", "VIRTUAL_ENV", "PYTEST_"))}
    env.update(PYTHONPATH=f"{ROOT}:{site}", LABKIT_CONSOLE="1", MPLBACKEND="Agg", LABKIT_BACKEND="cpu")
    cmd = [str(img.python_bin), "-m", "pytest", "tests/test_compile_instruments.py", "-q", "-o", "addopts="]
    cmd += ["-p", "no:cacheprovider", "-p", "no:logging", "-rfE"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.strip().splitlines()
    summary = next((ln for ln in reversed(lines) if " passed" in ln or " failed" in ln or " error" in ln), "")
    failed = sorted(
        {m.split("::")[-1].split(" ")[0] for m in re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)}
    )
    return dict(
        returncode=proc.returncode,
        summary=summary.strip("= "),
        seconds=time.perf_counter() - t0,
        failed=failed,
        output=(proc.stdout[-4000:] + proc.stderr[-2000:]) if proc.returncode else "",
    )


def run_instruments(out: Path) -> int:
    """The other job: the carried wheels into a folder of its own (as gpu_check.sh puts them), then the tests."""
    out.mkdir(parents=True, exist_ok=True)
    image_venv = load_image_venv()
    img = image_venv.load(ROOT / "images" / "device" / "nvidia-cuda.txt")
    image_venv.build(img, log=lambda msg: None)
    folder = image_venv.CACHE.parent / "labkit-gpu-wheels"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_wheels.py"), "--out", str(folder)], check=True)
    site = out / "site"
    pip = [str(img.python_bin), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
    subprocess.run([*pip, "--target", str(site), *map(str, sorted(folder.glob("*.whl")))], check=True)
    (out / "instruments.json").write_text(json.dumps(instruments_tests(img, site), indent=1))
    return 0


def run(out: Path) -> int:
    """The job: build or reuse the device venv, prepare and check the wheels, run the dry run into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    image_venv = load_image_venv()
    img = image_venv.load(ROOT / "images" / "device" / "nvidia-cuda.txt")
    built = image_venv.build(img, log=lambda msg: None)
    # the wheels are kept beside the uv cache, outside the checkout: CI's fresh clone downloads them once per machine
    folder = image_venv.CACHE.parent / "labkit-gpu-wheels"
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_wheels.py"), "--out", str(folder)]
    wheels = subprocess.run(cmd, capture_output=True, text=True)
    (out / "wheels.txt").write_text(wheels.stdout + wheels.stderr)
    rc = None
    if wheels.returncode == 0:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LABKIT_", "PYTHON", "VIRTUAL_ENV"))}
        env.update(img.run_env, OUT=str(out / "OUT"), PY=str(img.python_bin), PATH=f"{img.venv / 'bin'}:{env['PATH']}")
        env.update(GPU_CHECK_SITE=str(out / "site"), GPU_CHECK_LOGS=str(out / "logs"), WHEELS=str(folder))
        with open(out / "gpu_check.txt", "w") as log:
            rc = subprocess.run(
                ["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, stdout=log, stderr=log
            ).returncode
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)  # what the venv build, the wheels and the dry run used
    summary = dict(
        built=built,
        wheels_rc=wheels.returncode,
        gpu_check_rc=rc,
        seconds=time.perf_counter() - t0,
        cpu_seconds=cpu.ru_utime + cpu.ru_stime,
    )
    (out / "job.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    sys.exit(run_instruments(out) if mode == "instruments" else run(out))
