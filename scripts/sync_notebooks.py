"""Build each notebook's .ipynb (what Colab opens) from its jupytext py:percent source.

    python scripts/sync_notebooks.py            # rewrite notebooks/*.ipynb from notebooks/*.py
    python scripts/sync_notebooks.py --check    # exit 1 and name the notebooks whose .ipynb differ

The .py file is the source a linter and a reviewer read; the .ipynb is generated without outputs,
with stable cell ids (cell-00, cell-01, ...) so regenerating gives a clean diff, and with the
Colab metadata that makes "Open in Colab" pick a TPU runtime.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jupytext
import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def sources(folder: Path = NOTEBOOKS) -> list[Path]:
    """The notebook sources: .py files in the folder that carry a jupytext header."""
    return sorted(p for p in folder.glob("[0-9]*.py") if "jupytext:" in p.read_text()[:600])


def build(src: Path) -> nbformat.NotebookNode:
    nb = jupytext.read(src)
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"
        if cell.cell_type == "code":
            cell["outputs"], cell["execution_count"] = [], None
    md = nb.metadata
    md.get("jupytext", {}).pop("text_representation", None)  # carries jupytext's own version
    md["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    md["language_info"] = {"name": "python"}
    md["accelerator"] = "TPU"
    md["colab"] = {"provenance": []}
    return nb


def text(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when an .ipynb is stale")
    args = ap.parse_args(argv)
    stale = []
    for src in sources():
        out = src.with_suffix(".ipynb")
        want = text(build(src))
        if out.exists() and out.read_text() == want:
            continue
        if args.check:
            stale.append(out.name)
        else:
            out.write_text(want)
            print("wrote", out)
    if stale:
        print("stale (run python scripts/sync_notebooks.py):", ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
