"""Both notebooks run in each learner image (Colab TPU, Colab GPU, Kaggle TPU) and change none of its packages.

Each image is a venv, .venvs/<image>/, with the image's Python and pins (images/<image>.txt, built or
reused by scripts/image_venv.py). The driver (nbclient) runs here; the kernel is the image venv's Python,
with the image's environment markers, a stand-in google.colab in the Colab images, no PYTHONPATH, and
LABKIT_PIP_SPEC pointing at this checkout so the real set-up cell installs labkit from it. Training runs
on XLA:CPU (TPU images) or the plain CPU (GPU image). Checked: (a) every cell passes, (b) `pip freeze`
after the run has every package of the image at the same version (additions are listed), (c) the set-up
cell printed the platform and choice the image's header expects. Executed copies: artifacts/images/<image>/.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = [ROOT / "notebooks" / "01_resnet50_cifar10.ipynb", ROOT / "notebooks" / "02_transformer_lm.ipynb"]
CELL_TIMEOUT = 1200

_spec = importlib.util.spec_from_file_location("image_venv", ROOT / "scripts" / "image_venv.py")
image_venv = importlib.util.module_from_spec(_spec)
sys.modules["image_venv"] = image_venv  # dataclasses look their module up there
_spec.loader.exec_module(image_venv)

pytestmark = pytest.mark.images

# the outer test run's settings that a learner's kernel does not have
_DROP = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MPLBACKEND", "PJRT_DEVICE", "JUPYTER_PATH", "IPYTHONDIR")


def kernel_env(img, workdir: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _DROP and not k.startswith(("LABKIT_", "COLAB_", "KAGGLE_", "TPU_"))
    }
    env.update(img.env)
    env.update(img.run_env)
    env.update(
        LABKIT_FAST="1",
        LABKIT_PIP_SPEC=str(ROOT),  # the set-up cell installs labkit from this checkout
        IPYTHONDIR=str(workdir / "ipython"),  # no profile of this machine's user
        PYTHONNOUSERSITE="1",
    )
    return env


def write_kernelspec(img, jupyter_dir: Path) -> str:
    name = f"image-{img.name}"
    spec = jupyter_dir / "kernels" / name
    spec.mkdir(parents=True, exist_ok=True)
    argv = [str(img.python_bin), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": img.name, "language": "python"}))
    return name


def setup_lines(nb) -> list[str]:
    """What the set-up cell printed, lines starting with 'labkit setup:'."""
    lines = []
    for cell in nb.cells:
        if "setup" in cell.metadata.get("tags", []):
            for out in cell.get("outputs", []):
                text = out.get("text", "") if out.get("output_type") == "stream" else ""
                lines += [ln.strip() for ln in text.splitlines() if ln.strip().startswith("labkit setup:")]
    return lines


def _field(lines: list[str], key: str) -> str | None:
    for ln in lines:
        m = re.search(rf"\b{key}=(\S+)", ln)
        if m:
            return m.group(1)
    return None


def run_notebook(path: Path, img, kernel: str, workdir: Path, out_dir: Path) -> dict:
    nb = nbformat.read(path, as_version=4)
    env = kernel_env(img, workdir)
    env["LABKIT_ARTIFACTS"] = str(out_dir / path.stem)
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name=kernel, resources={"metadata": {"path": str(workdir)}}
    )
    t0 = time.perf_counter()
    error = None
    try:
        client.execute(env=env)
    except CellExecutionError as e:
        error = str(e)
    finally:
        nbformat.write(nb, out_dir / path.name)
    return {"seconds": time.perf_counter() - t0, "error": error, "setup": setup_lines(nb)}


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", image_venv.image_names())
def test_notebooks_in_image(name, tmp_path, monkeypatch, capsys):
    img = image_venv.load(name)
    built = image_venv.build(img, log=lambda msg: None)
    before = image_venv.freeze(img.python_bin)
    assert before == image_venv.expected_freeze(img), "the image venv is not the image before the run"

    jupyter_dir = tmp_path / "jupyter"
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter_dir))  # the driver finds the image's kernelspec here
    kernel = write_kernelspec(img, jupyter_dir)
    out_dir = ROOT / "artifacts" / "images" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    runs = {}
    for path in NOTEBOOKS:
        workdir = tmp_path / path.stem  # data/ and checkpoints/ land here, not next to the committed notebook
        workdir.mkdir()
        runs[path.stem] = run_notebook(path, img, kernel, workdir, out_dir)

    after = image_venv.freeze(img.python_bin)
    changed = {k: f"{v} -> {after.get(k, 'removed')}" for k, v in before.items() if after.get(k) != v}
    added = {k: after[k] for k in sorted(set(after) - set(before))}

    with capsys.disabled():
        print(f"\n[images] {name} (Python {img.python}): venv {built['action']} in {built['seconds']:.1f} s")
        for stem, r in runs.items():
            print(f"[images] {name} {stem}: {r['seconds']:.0f} s, {'FAILED' if r['error'] else 'passed'}")
            for ln in r["setup"]:
                print(f"[images] {name} {stem}:   {ln}")
        print(f"[images] {name}: added {added or 'nothing'}")
        if changed:
            print(f"[images] {name}: CHANGED {changed}")

    problems = []
    for stem, r in runs.items():  # (a) the notebooks pass
        if r["error"]:
            problems.append(f"{stem} failed in {name} (executed copy in {out_dir}):\n{r['error'][-4000:]}")
    if changed:  # (b) the image's packages are untouched
        problems.append(f"the notebooks changed packages of {name}: {changed} (added: {added})")
    for stem, r in runs.items():  # (c) the set-up cell recognised the image and kept its torch
        for key, want in img.expect.items():
            got = _field(r["setup"], key)
            if got != want:
                problems.append(
                    f"{stem} in {name}: set-up cell printed {key}={got}, expected {key}={want}; its lines: {r['setup']}"
                )
    assert not problems, "\n\n".join(problems)
