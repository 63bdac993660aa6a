"""The notebooks run in each learner image (Colab TPU, Colab GPU, Kaggle TPU) and change none of its packages.

Each image is a venv, .venvs/<image>/, with the image's Python and pins (images/<image>.txt, built or
reused by scripts/image_venv.py). The driver (nbclient) runs in a child process (tests/children/image_job.py,
started in the background when collection ends: tests/background.py); the kernel is the image venv's
Python, with the image's environment markers, a stand-in google.colab in the Colab images, no PYTHONPATH,
and LABKIT_PIP_SPEC pointing at this checkout so the real set-up cell installs labkit from it. Training
runs on XLA:CPU (TPU images) or the plain CPU (GPU image). Which notebooks each image runs is its header's `# notebooks:` line (README, "Where it runs"). Checked: (a) every cell passes, (b) `pip freeze`
after the run has every package of the image at the same version (additions are listed), (c) the set-up
cell printed the platform and choice the image's header expects, (d) the notebooks run as a learner's Run all
does, with LABKIT_SOLUTIONS=0: every exercise, unsolved, prints "✗ ...: not yet: ..." and no later cell fails
(the main suite runs the same notebooks with the solutions on). Executed copies: artifacts/images/<image>/.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from tests import background
from tests.children.image_job import ROOT, field_of, load_image_venv

image_venv = load_image_venv()
pytestmark = pytest.mark.images
# CPU-seconds of each image's job, measured in a full run (closing table): the workers start the longest first
EXPECTED_S = {"kaggle-tpu": 556, "colab-gpu": 244, "torchtpu-vm": 280, "colab-tpu": 142}


def job(name: str) -> background.Job:
    out = Path(background.job_dir()) / f"{name}.json"
    argv = [sys.executable, str(ROOT / "tests" / "children" / "image_job.py"), name, str(out)]
    return background.Job(id=f"image-{name}", argv=argv, cwd=str(ROOT), expected_s=EXPECTED_S.get(name, 300))


def background_job(item) -> background.Job:
    return job(item.callspec.params["name"])


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", image_venv.image_names())
def test_notebooks_in_image(name, capsys):
    done = background.wait(f"image-{name}", job(name))
    result_file = Path(done.argv[-1])
    assert done.returncode == 0 and result_file.exists(), f"the image job failed:\n{background.output(done)[-6000:]}"
    r = json.loads(result_file.read_text())
    built, runs, changed, added = r["built"], r["runs"], r["changed"], r["added"]
    assert r["pristine"], "the image venv is not the image before the run"

    with capsys.disabled():
        print(f"\n[images] {name} (Python {r['python']}): venv {built['action']} in {built['seconds']:.1f} s")
        for stem, run in runs.items():
            unsolved = sum(any("not yet" in ln for ln in v) for v in run.get("exercises", {}).values())
            print(
                f"[images] {name} {stem}: {run['seconds']:.0f} s, {'FAILED' if run['error'] else 'passed'}, "
                f"{unsolved} of {len(run.get('exercises', {}))} unsolved exercises said 'not yet'"
                + (
                    f"; its first {run['cells']} cells, up to the one tagged {run['until']!r}"
                    if run.get("until")
                    else ""
                )
            )
            for ln in run["setup"]:
                print(f"[images] {name} {stem}:   {ln}")
        print(f"[images] {name}: added {added or 'nothing'}")
        if changed:
            print(f"[images] {name}: CHANGED {changed}")

    problems = []
    for stem, run in runs.items():  # (a) the notebooks pass
        if run["error"]:
            problems.append(f"{stem} failed in {name} (executed copy in {r['out_dir']}):\n{run['error'][-4000:]}")
    if changed:  # (b) the image's packages are untouched
        problems.append(f"the notebooks changed packages of {name}: {changed} (added: {added})")
    stops = set(r.get("stops", []))
    for stem, run in runs.items():  # (e) a notebook whose stack the image lacks ends at its set-up cell, and says why
        if stem[:2] in stops:
            problems += stop_problems(stem, name, run.get("stop"))
    for stem, run in runs.items():  # (d) Run all with the exercises unsolved: each one says "not yet", none passes
        if stem[:2] in stops:
            continue
        exercises = run.get("exercises", {})
        if not exercises and not run["error"]:
            problems.append(f"{stem} in {name}: no exercise check found in the executed notebook")
        for ex_name, lines in exercises.items():
            if run["error"]:
                break  # the failure above says more
            if not any(ln.startswith(f"✗ {ex_name}: not yet") for ln in lines):
                problems.append(
                    f"{stem} in {name}: exercise {ex_name}, unsolved, printed {lines or 'nothing'}; expected "
                    f"'✗ {ex_name}: not yet: ...'"
                )
    for stem, run in runs.items():  # (c) the set-up cell recognised the image and kept its torch
        for key, want in r["expect"].items():
            got = field_of(run["setup"], key)
            if got != want:
                problems.append(
                    f"{stem} in {name}: set-up cell printed {key}={got}, expected {key}={want}; its lines: {run['setup']}"
                )
    assert sorted(runs) == sorted(r["notebooks"]) and not problems, (
        "\n\n".join(problems) or f"notebooks run: {sorted(runs)}"
    )


def stop_problems(stem: str, image: str, stop: dict | None) -> list[str]:
    """A notebook that needs torch_xla, in an image without it: it ended at its set-up cell with labkit's message (no
    traceback frames), no later cell ran, and the message names what it needs and both ways to get it."""
    if not stop or stop.get("cell") is None:
        return [f"{stem} in {image}: expected to end at its set-up cell, but no cell stopped it"]
    out = []
    if not stop["setup_cell"] or stop["ename"] != "NeedsTorchXla":
        out.append(f"{stem} in {image}: ended at cell {stop['cell']} with {stop['ename']}, not at its set-up cell")
    if stop["later_cells_run"]:
        out.append(f"{stem} in {image}: {stop['later_cells_run']} cell(s) ran after the set-up cell stopped it")
    shown = "\n".join(stop["traceback"])
    if "Traceback" in shown or 'File "' in shown or stop["traceback"] != [stop["message"]]:
        out.append(f"{stem} in {image}: the stop showed a traceback, not only its message:\n{shown[-2000:]}")
    for needed in ("torch_xla", "Colab's TPU runtime", "LABKIT_INSTALL_TORCH_XLA=1", "Nothing was installed"):
        if needed not in stop["message"]:
            out.append(f"{stem} in {image}: the stop's message does not say {needed!r}: {stop['message']!r}")
    return out


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("name", [n for n in image_venv.image_names() if "torch-tpu" in image_venv.load(n).pins])
def test_torch_tpu_contract(name, capsys):
    """The real torch-tpu package, imported in its image (no chip): every name labkit calls exists and takes what
    labkit passes; "tpu" is a torch.compile backend and the process-group backend torch_tpu's loader registers;
    labkit keeps libtpu off the metadata server, says in one line that it found TorchTPU and no chips, and trains on
    the CPU, where a backward returns (the child's timeout, 180 s, would call a metadata-server wait a hang)."""
    done = background.wait(f"image-{name}", job(name))
    result_file = Path(done.argv[-1])
    assert done.returncode == 0 and result_file.exists(), f"the image job failed:\n{background.output(done)[-6000:]}"
    c = json.loads(result_file.read_text())["contract"]
    assert c is not None, f"{name}: the image job ran no contract"
    with capsys.disabled():
        print(
            f"\n[images] {name} TorchTPU contract: {len(c.get('calls', {}))} names checked, import torch "
            f"{c.get('import_s', float('nan')):.1f} s, a CPU backward {c.get('backward_s', float('nan')):.2f} s, "
            f"the whole child {c['seconds']:.0f} s"
        )
    assert not c["problems"], "\n".join(c["problems"]) + f"\n{c.get('stderr', '')}"
    assert c["torch_tpu_loaded"], "torch_tpu did not load with torch (its backend autoload)"
    assert c["env_set_by_labkit"] == "1", f"TPU_SKIP_MDS_QUERY after import labkit: {c['env_set_by_labkit']!r}"
    assert c["compile_backends_has_tpu"] and c["process_group_backend"]
    assert c["loader_registers"] == ["tpu_dist", "tpu"] and not c["registered_without_chips"]
    assert c["chips"] == 0 and c["runtime"] == {"kind": "cpu", "device": "cpu"}, c["runtime"]
    libtpu_logs = [ln for ln in c["stderr"].splitlines() if re.match(r"[IWEF]\d{4} ", ln)]
    assert not libtpu_logs, f"libtpu's start-up logs reached the output without a chip: {libtpu_logs[:5]}"
    assert "tcmalloc" not in c["stderr"], c["stderr"][-2000:]
    lines = [ln for ln in c["setup_printed"].splitlines() if "TorchTPU" in ln]
    assert len(lines) == 1 and "no TPU chips" in lines[0] and "running on cpu" in lines[0], c["setup_printed"]
