"""Colab's kernel stack for tests that need it: ipykernel 6.17.1 and ipywidgets 7.7.1 (images/colab-tpu.txt),
in a small venv, .venvs/colab-kernel, built with uv; torch, torch_xla and labkit's other dependencies come
from the project venv through a .pth file placed after the venv's own site-packages. Used by
tests/test_browser.py (a browser on that kernel) and tests/test_dashboard_controls.py (its widget messages)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COLAB_KERNEL = ROOT / ".venvs" / "colab-kernel"
COLAB_KERNEL_PACKAGES = ["ipykernel", "ipywidgets"]  # at Colab's versions: images/colab-tpu.txt is the constraint

# The front end's widget manager for ipywidgets 7 kernels. JupyterLab 4 with jupyterlab_widgets 3.0.17 (the
# lock's, for ipywidgets 8) cannot draw them: "Module @jupyter-widgets/controls, version ^1.5.0 is not
# registered, however, 2.0.0 is" (measured). jupyterlab_widgets 1.1.11 (the last of the 1.x line, made for
# ipywidgets 7, declares JupyterLab "^3 || ^4") draws them in JupyterLab 4.6. Colab draws them with its own
# front end; 1.1.11 goes into the kernel venv and that server is pointed at it with JUPYTER_PATH.
WIDGETS7_FRONT_END = "jupyterlab_widgets==1.1.11"


def site_dirs() -> list[str]:
    """The site-packages of the interpreter running the tests (torch, torch_xla, labkit's dependencies)."""
    return [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]


def colab_kernel() -> Path:
    """A venv with Colab's kernel and widget pins (uv, the shared cache of scripts/image_venv.py); everything
    else (torch, torch_xla, numpy, ...) comes from the project venv through a .pth file placed after it."""
    uv = shutil.which("uv", path=f"{Path(sys.executable).parent}:{ROOT / '.venv' / 'bin'}")
    if uv is None:
        pytest.skip("uv is not installed (it is in requirements.txt): run `make venv`")
    pins = (ROOT / "images" / "colab-tpu.txt").read_text()
    what = pins + repr(COLAB_KERNEL_PACKAGES) + WIDGETS7_FRONT_END + repr(site_dirs()) + "pyc"
    stamp_want = hashlib.sha256(what.encode()).hexdigest()
    stamp = COLAB_KERNEL / ".labkit-stamp"
    py = COLAB_KERNEL / "bin" / "python"
    if stamp.exists() and stamp.read_text() == stamp_want and py.exists():
        return py
    env = dict(os.environ, UV_CACHE_DIR=os.environ.get("LABKIT_UV_CACHE") or str(Path.home() / ".cache" / "labkit-uv"))
    env["UV_COMPILE_BYTECODE"] = "1"  # .pyc at install, as pip writes them (scripts/image_venv.py says why)
    shutil.rmtree(COLAB_KERNEL, ignore_errors=True)
    base = os.path.realpath(sys.executable)
    subprocess.run([uv, "venv", "-q", "--python", base, str(COLAB_KERNEL)], check=True, env=env)
    cmd = [uv, "pip", "install", "-q", "--python", str(py), "-c", str(ROOT / "images" / "colab-tpu.txt")]
    done = subprocess.run(cmd + COLAB_KERNEL_PACKAGES, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"building {COLAB_KERNEL} with Colab's kernel pins failed:\n{done.stderr}"
    done = subprocess.run(
        cmd[:4] + ["--python", str(py), "--no-deps", WIDGETS7_FRONT_END], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, f"installing {WIDGETS7_FRONT_END} into {COLAB_KERNEL} failed:\n{done.stderr}"
    purelib = subprocess.check_output([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    Path(purelib.decode().strip(), "zz_labkit_project.pth").write_text("\n".join(site_dirs()) + "\n")
    stamp.write_text(stamp_want)
    return py


def start_kernel(python: Path, home: Path):
    """A kernel of `python` (its own ipykernel), started by jupyter_client from a kernel spec written under
    `home`, in the project root with the project on PYTHONPATH. Returns (manager, client), channels ready."""
    import json

    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    spec = home / "kernels" / "labkit-test"
    spec.mkdir(parents=True)
    argv = [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "test", "language": "python"}))
    km = KernelManager(kernel_name="labkit-test", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)]))
    km.start_kernel(cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
    except Exception:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        raise
    return km, kc
