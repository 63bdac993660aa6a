"""Run notebooks headless, save the executed copies and every figure they drew.

    python scripts/run_notebooks.py notebooks/01_resnet50_cifar10.ipynb [more.ipynb] [--out artifacts]

Each notebook runs in a fresh kernel of this Python (the project venv), with its folder as the
working directory. All notebooks of one invocation share one artifacts folder, OUT/shared
($LABKIT_ARTIFACTS: checkpoints, saved curves), so 01 -> 05 chain as a learner would run them. Executed copies go to OUT/<name>.ipynb; every image/png output is written
to OUT/<name>/figure-<cell>-<n>.png so a person can look at them. What the cells printed (loss,
accuracy, the XLA summary) is echoed with the cell number unless --quiet. Exits non-zero if a cell fails.
--stop-before REGEX runs each notebook only up to the first code cell whose source matches (e.g. its first training
cell): its imports, parameters and set-up, for a dry run where the whole notebook costs too much.
"""

from __future__ import annotations

import argparse
import base64
import os
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError


def run(path: Path, out: Path, timeout: int, quiet: bool = False, stop_before: str | None = None) -> float:
    nb = nbformat.read(path, as_version=4)
    if stop_before:
        pattern = re.compile(stop_before)
        cut = next((i for i, c in enumerate(nb.cells) if c.cell_type == "code" and pattern.search(c.source)), None)
        if cut is None:
            raise ValueError(f"{path}: no code cell matches --stop-before {stop_before!r}")
        print(f"[run_notebooks] {path.name}: cells 0-{cut - 1} of {len(nb.cells)} (cell {cut} matches {stop_before!r})")
        nb.cells = nb.cells[:cut]
    # the kernel's own inline backend renders figures into the executed copy without a display;
    # MPLBACKEND=Agg (right for pytest) would make plt.show() and returned figures draw nothing
    os.environ.pop("MPLBACKEND", None)
    (out / path.stem).mkdir(parents=True, exist_ok=True)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent.resolve())}}
    )
    t0 = time.perf_counter()
    try:
        client.execute()
    finally:
        elapsed = time.perf_counter() - t0
        nbformat.write(nb, out / path.name)
        n = 0
        for i, cell in enumerate(nb.cells):
            for o in cell.get("outputs", []):
                if o.get("output_type") == "stream" and o.get("name") == "stdout" and not quiet:
                    lines = o["text"].rstrip("\n").splitlines()  # what the cell printed: loss, accuracy, XLA summary
                    print("\n".join(f"  [{i:02d}] {ln}" for ln in lines[:25]), flush=True)
                data = o.get("data", {})
                if "image/png" in data:
                    n += 1
                    (out / path.stem / f"figure-{i:02d}-{n}.png").write_bytes(base64.b64decode(data["image/png"]))
        print(f"[run_notebooks] {path.name}: {elapsed:.1f} s, {n} figure(s) -> {out / path.stem}", flush=True)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path("artifacts"))
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per cell")
    ap.add_argument("--quiet", action="store_true", help="do not echo what the cells printed")
    ap.add_argument("--stop-before", default=None, help="run cells up to the first code cell matching this regex")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # ONE artifacts folder for every notebook of this run, so they chain: notebook 01's and 02's checkpoints
    # are what 05 exports and quantizes (with a folder per notebook 05 never found them and trained a stand-in)
    os.environ["LABKIT_ARTIFACTS"] = str((args.out / "shared").resolve())
    print(f"[run_notebooks] LABKIT_ARTIFACTS={os.environ['LABKIT_ARTIFACTS']} (shared by all notebooks)", flush=True)
    failed = 0
    for nb in args.notebooks:
        try:
            run(nb, args.out, args.timeout, args.quiet, args.stop_before)
        except CellExecutionError as e:
            failed += 1
            print(f"[run_notebooks] {nb} FAILED:\n{str(e)[-3000:]}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
