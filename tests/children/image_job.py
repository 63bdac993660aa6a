"""Child process of tests/test_images.py and tests/test_py313.py (run in the background, tests/background.py).

    python tests/children/image_job.py IMAGE OUT.json      # the image's notebooks (its '# notebooks:' line) in .venvs/IMAGE
    python tests/children/image_job.py py3.13 [TEST_FILE ...] OUT.json   # those unit tests on Python 3.13 (the lock)

Writes what the test asserts on to OUT.json; the test prints and checks it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[2]


def notebooks_of(img) -> list[Path]:
    """The notebooks an image runs, from its header's `# notebooks: 01 02 ...` line (number prefixes)."""
    found = []
    for prefix in img.notebooks:
        match = sorted((ROOT / "notebooks").glob(f"{prefix}_*.ipynb"))
        if len(match) != 1:
            raise FileNotFoundError(
                f"{img.pin_file}: '# notebooks:' names {prefix}, which matches {match or 'no notebook'}"
            )
        found.append(match[0])
    return found


# What a run in an image adds to the kernel's environment for one notebook (none today: notebook 01's fast mode
# trains the one epoch the images used to ask for).
PER_NOTEBOOK_ENV: dict[str, dict[str, str]] = {}

# An image whose header says `# devices: 01=2 02=4` (Kaggle's v5e-8: one process drives every chip) runs those
# notebooks on that many virtual XLA:CPU devices, where their spmd="auto" switches SPMD on. The batch size is per
# chip, so a fraction of the fast size keeps the 1-device run's global batch of 32 (and the learning its asserts
# check). tests/test_spmd.py reads these runs: SPMD over every device, no recompilation after warm-up, the lr rule.
MULTI_DEVICE_ENV = {
    # notebook 01 scales the lr from the per-chip batch to the global one (AdamW in fast mode: square-root rule,
    # x sqrt(32 / 16)), so 1e-3 / sqrt(2) gives the 1-device run's learning rate back. 2 devices, not 4: ResNet-50's
    # partitioned step on 4 virtual devices sharing 2 cores ran at ~6 images/s (686 s for this epoch); a 2-device
    # mesh exercises the same sharded batches, evaluation counts, checkpoints and lr rule as a 4-device one.
    "01_resnet50_cifar10": {"LABKIT_BATCH_SIZE": "16", "LABKIT_LR": "0.000707107"},
    "02_transformer_lm": {"LABKIT_BATCH_SIZE": "4"},
}


def notebook_env(img, stem: str) -> dict[str, str]:
    """What a run of notebook `stem` adds to the kernel's environment in image `img`."""
    env = dict(PER_NOTEBOOK_ENV.get(stem, {}))
    devices = img.devices.get(stem[:2], 1)
    if devices > 1:
        if stem not in MULTI_DEVICE_ENV:
            raise ValueError(
                f"{img.pin_file}: '# devices:' runs {stem} on {devices} devices, but tests/children/image_job.py "
                "has no per-chip batch for it in MULTI_DEVICE_ENV"
            )
        env.update(MULTI_DEVICE_ENV[stem], CPU_NUM_DEVICES=str(devices))
    return env


CELL_TIMEOUT = 2400  # a hang guard: the image runs share the cores with the rest of the suite


def load_image_venv():
    spec = importlib.util.spec_from_file_location("image_venv", ROOT / "scripts" / "image_venv.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["image_venv"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


# the outer test run's settings that a learner's kernel does not have
_DROP = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "MPLBACKEND", "PJRT_DEVICE", "JUPYTER_PATH", "IPYTHONDIR")


def source_copy(dest: Path) -> Path:
    """The checkout's files (git's tracked and untracked ones, not the ignored: no venvs, no artifacts) copied to
    `dest`, for the set-up cell to install labkit from. pip builds a local folder in place, in its build/ folder:
    two image jobs installing from the checkout itself at once collided there ("File exists:
    build/bdist.linux-x86_64/wheel/labkit_xla-0.1.0.dist-info"). A git URL, a learner's way, is built in a fresh
    folder too."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        src = ROOT / name
        if src.is_file():  # (tracked, but deleted in the work tree)
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def kernel_env(img, workdir: Path, source: Path = ROOT) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _DROP and not k.startswith(("LABKIT_", "COLAB_", "KAGGLE_", "TPU_"))
    }
    env.update(img.env)
    env.update(img.run_env)
    env.update(
        LABKIT_FAST="1",
        # the learner's path: Run all with every exercise unsolved (the main suite runs the solutions)
        LABKIT_SOLUTIONS="0",
        LABKIT_PIP_SPEC=str(source),  # the set-up cell installs labkit from this checkout (a copy: source_copy)
        IPYTHONDIR=str(workdir / "ipython"),  # no profile of this machine's user
        LABKIT_SCRATCH=str(workdir / "scratch"),  # labkit.scratch() folders: removed with workdir, not left in /tmp
        # the suite's one Inductor cache (conftest.py puts it in the session's scratch folder): graphs a notebook
        # compiled before in this run, in this image or another with the same torch and Python, load from it
        TORCHINDUCTOR_CACHE_DIR=os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(workdir / "inductor"),
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


def field_of(lines: list[str], key: str) -> str | None:
    for ln in lines:
        m = re.search(rf"\b{key}=(\S+)", ln)
        if m:
            return m.group(1)
    return None


CHECK = re.compile(r"""\bcheck\(\s*["']([\w.]+)["']""")


def exercise_lines(nb) -> dict[str, list[str]]:
    """For every exercise check in the notebook's source (`ex.check("01.resume", ...)`), the lines its run printed
    about it ("✓ 01.resume: pass ..." or "✗ 01.resume: not yet: ...")."""
    found: dict[str, list[str]] = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        names = CHECK.findall(cell.source)
        text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
        for name in names:
            found[name] = [ln.strip() for ln in text.splitlines() if re.match(rf"\s*[✓✗] {re.escape(name)}:", ln)]
    return found


def cpu_s() -> float:
    """User + system CPU seconds of this process and its reaped children (a part's cost: the difference)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def cut_at_tag(nb, tag: str, path: Path) -> int:
    """Keep the cells before the first code cell tagged `tag` (an image's `# until: 01=training` line); their count."""
    cut = next((i for i, c in enumerate(nb.cells) if tag in c.metadata.get("tags", [])), None)
    if cut is None:
        raise ValueError(f"{path.name}: no cell is tagged {tag!r}, which an image's '# until:' line names")
    nb.cells = nb.cells[:cut]
    return cut


def run_notebook(path: Path, img, kernel: str, workdir: Path, out_dir: Path, source: Path = ROOT) -> dict:
    nb = nbformat.read(path, as_version=4)
    until = img.until.get(path.stem[:2])
    cells = cut_at_tag(nb, until, path) if until else len(nb.cells)
    env = kernel_env(img, workdir, source)
    env["LABKIT_ARTIFACTS"] = str(out_dir / path.stem)
    env.update(notebook_env(img, path.stem))
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name=kernel, resources={"metadata": {"path": str(workdir)}}
    )
    t0, c0 = time.perf_counter(), cpu_s()
    error = None
    try:
        client.execute(env=env)
    except CellExecutionError as e:
        error = str(e)
    finally:
        nbformat.write(nb, out_dir / path.name)
    stop = stop_of(nb) if path.stem[:2] in img.stops else None
    if stop is not None and stop["ename"] == "NeedsTorchXla" and error:
        error = None  # the notebook ended where it must: test_images checks how (stop_problems)
    return {
        "seconds": time.perf_counter() - t0,
        "cpu_s": cpu_s() - c0,  # the kernel's too: nbclient reaps it before execute() returns
        "error": error,
        "stop": stop,
        "setup": setup_lines(nb),
        "exercises": exercise_lines(nb),
        "devices": int(env.get("CPU_NUM_DEVICES", "1")),
        "until": until,  # None: the whole notebook; else the tag of the first cell left out
        "cells": cells,
        "printed": printed(nb),
    }


def stop_of(nb) -> dict:
    """Where and how a notebook that must end at its set-up cell (an image's `# stops:` line) ended: the first cell
    with an error output, that error's name, message and traceback lines, and whether any later cell ran."""
    for i, cell in enumerate(nb.cells):
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            later = [c for c in nb.cells[i + 1 :] if c.cell_type == "code" and c.get("execution_count") is not None]
            return {
                "cell": i,
                "setup_cell": "setup" in cell.metadata.get("tags", []),
                "ename": errors[0].get("ename"),
                "message": errors[0].get("evalue", ""),
                "traceback": errors[0].get("traceback", []),
                "later_cells_run": len(later),
            }
    return {"cell": None, "setup_cell": False, "ename": None, "message": "", "traceback": [], "later_cells_run": 0}


def contract_run(img, python: Path) -> dict | None:
    """The TorchTPU contract (tests/children/torch_tpu_contract.py) in an image that has torch-tpu, else None. The
    timeout is the hang guard: a CPU backward that waits on the cloud metadata server never ends in time."""
    if "torch-tpu" not in img.pins:
        return None
    env = {k: v for k, v in os.environ.items() if k not in _DROP and not k.startswith(("LABKIT_", "TPU_"))}
    env.update(img.env, PYTHONPATH=str(ROOT), PYTHONNOUSERSITE="1")
    out = Path(tempfile.mkdtemp(prefix="torch-tpu-contract-")) / "contract.json"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [str(python), str(ROOT / "tests" / "children" / "torch_tpu_contract.py"), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=CONTRACT_TIMEOUT,
        )
        result = json.loads(out.read_text()) if out.exists() else {"problems": ["it wrote no result"]}
        result.update(returncode=proc.returncode, stderr=proc.stderr[-3000:])
    except subprocess.TimeoutExpired as e:
        result = {"problems": [f"no result after {CONTRACT_TIMEOUT} s: a hang"], "stderr": str(e.stderr)[-3000:]}
    result["seconds"] = time.perf_counter() - t0
    shutil.rmtree(out.parent, ignore_errors=True)
    return result


# import torch with torch_tpu's autoload takes ~8-12 s; a backward that waits on the metadata server took > 200 s
CONTRACT_TIMEOUT = 180


def printed(nb, limit: int = 200_000) -> str:
    """Everything the notebook's cells printed (stream outputs), for tests that read a run's lines."""
    text = "".join(
        o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "stream"
    )
    return text[-limit:]


def image_run(name: str) -> dict:
    image_venv = load_image_venv()
    img = image_venv.load(name)
    c0 = cpu_s()
    built = image_venv.build(img, log=lambda msg: None)
    built = dict(built, cpu_s=cpu_s() - c0)
    before = image_venv.freeze(img.python_bin)
    pristine = before == image_venv.expected_freeze(img)
    tmp = Path(tempfile.mkdtemp(prefix=f"image-{name}-"))
    jupyter_dir = tmp / "jupyter"
    os.environ["JUPYTER_PATH"] = str(jupyter_dir)  # the driver finds the image's kernelspec here
    kernel = write_kernelspec(img, jupyter_dir)
    out_dir = ROOT / "artifacts" / "images" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    runs = {}
    contract = contract_run(img, img.python_bin) if pristine else None
    if pristine:
        source = source_copy(tmp / "labkit")
        for path in notebooks_of(img):
            workdir = tmp / path.stem  # data/ and checkpoints/ land here, not next to the committed notebook
            workdir.mkdir()
            runs[path.stem] = run_notebook(path, img, kernel, workdir, out_dir, source)
    after = image_venv.freeze(img.python_bin)
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "python": img.python,
        "expect": img.expect,
        "notebooks": [p.stem for p in notebooks_of(img)],
        "built": built,
        "pristine": pristine,
        "runs": runs,
        "contract": contract,
        "stops": list(img.stops),
        "changed": {k: f"{v} -> {after.get(k, 'removed')}" for k, v in before.items() if after.get(k) != v},
        "added": {k: after[k] for k in sorted(set(after) - set(before))},
        "out_dir": str(out_dir),
    }


def py313_run(modules: list[str]) -> dict:
    image_venv = load_image_venv()
    c0 = cpu_s()
    built = image_venv.build_lock_venv("3.13", log=lambda msg: None)
    built = dict(built, cpu_s=cpu_s() - c0)
    drop = ("VIRTUAL_ENV", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONPATH=str(ROOT), PJRT_DEVICE="CPU", LABKIT_FAST="1", MPLBACKEND="Agg", LABKIT_CONSOLE="1")
    py = built["python"]
    version = subprocess.run([py, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True, text=True)
    cmd = [
        py,
        "-m",
        "pytest",
        *(modules or ["tests"]),
        "-m",
        "not images and not heavy",
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    t0, c0 = time.perf_counter(), cpu_s()
    proc = subprocess.run(cmd + ["--timeout=900"], cwd=ROOT, env=env, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|error)", ln)), "(no summary)")
    return {
        "built": {k: str(v) for k, v in built.items()},
        "version": version.stdout.strip(),
        "seconds": time.perf_counter() - t0,
        "cpu_s": cpu_s() - c0,
        "returncode": proc.returncode,
        "summary": summary.strip("= "),
        "stdout": _report(proc.stdout),
        "stderr": proc.stderr[-3000:],
    }


def _report(out: str, n: int = 6000) -> str:
    """pytest's failures section (the warnings summary after it would push it out of a plain tail) and its
    last lines; the tail alone when nothing failed."""
    found = [i for i in (out.find("= ERRORS ="), out.find("= FAILURES =")) if i >= 0]
    if not found:
        return out[-n:]
    start = min(found)
    return out[start : start + n] + "\n[...]\n" + out[-1500:]


def main(argv=None) -> int:
    args = argv or sys.argv[1:]
    name, modules, out = args[0], args[1:-1], args[-1]
    result = py313_run(modules) if name == "py3.13" else image_run(name)
    Path(out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
