"""Build the course as a static site from the executed notebooks (outputs and figures included).

    python scripts/build_book.py                      # executed copies from artifacts/ -> artifacts/book/
    python scripts/build_book.py --executed DIR --out SITE [notebooks/01_x.ipynb ...]

`make book` runs `make notebooks` first (fast mode, executed copies in artifacts/), then this. The tool is
mkdocs-jupyter (MkDocs + nbconvert, pure Python from PyPI, no network and no Node.js at build time; Jupyter
Book 2 needs Node.js). The index page gives the course order (COURSE below, its one home: the README's course
line and each notebook's "In the course" line follow it, tests/test_notebooks.py checks; whatever notebooks
exist, one COURSE does not name goes last by number), each notebook's title and objective read from its first cell, and the time each took
to run here, read from the execution timestamps nbclient writes into the executed copy. A notebook with no
executed copy goes in as its source (no outputs) and the index says so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
REPO_URL = "https://github.com/labkit/labkit"
# The course order, by notebook number. 04's tools (recompile detective, sync finder, profiler) are used by 01,
# 02, 03 and 07, so it comes right after 00; 06 (data someone else wrote) follows 01 (shards labkit wrote);
# 08 (torch.compile + DTensor, the compiled engine) builds on 00, 03 and 04; 07 is the capstone; 10 (from torch_xla
# to TorchTPU) comes after it, because its map points back to every notebook before it, the capstone's tools
# included; 05 (serving on a CPU) is an appendix.
COURSE = ("00", "04", "01", "06", "02", "03", "08", "09", "07", "10", "05")
APPENDIX = ("05",)


def course_key(path: Path) -> tuple[int, str]:
    num = path.name[:2]
    return (COURSE.index(num) if num in COURSE else len(COURSE), path.name)


def course(notebooks: list[Path], executed: Path) -> list[dict]:
    """One entry per notebook, in course order: source, the copy that goes into the book, title, objective, minutes."""
    out = []
    for src in sorted(notebooks, key=course_key):
        run = executed / src.name
        nb = nbformat.read(run if run.exists() else src, as_version=4)
        title, objective = headline(nb)
        out.append(
            {
                "src": src,
                "copy": run if run.exists() else src,
                "executed": run.exists(),
                "title": title or src.stem,
                "objective": objective,
                "minutes": run_minutes(nb) if run.exists() else None,
            }
        )
    return out


def headline(nb) -> tuple[str, str]:
    """The first markdown cell's `# title` and its first prose paragraph (two sentences at most); a paragraph
    that introduces a numbered list ("...: 1. **Set-up**: ...") gets the list's bold heads."""
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        title, blocks = "", [b.strip() for b in re.split(r"\n\s*\n", cell.source) if b.strip()]
        for i, block in enumerate(blocks):
            if block.startswith("# ") and not title:
                title = block[2:].splitlines()[0].strip()
            elif not block.startswith(("[![", "#", "1.", "-", "*", "|")):
                text = " ".join(re.split(r"(?<=[.!?])\s+", " ".join(block.split()))[:2])
                heads = re.findall(r"^\d+\. \*\*(.+?)\*\*", blocks[i + 1], re.M) if i + 1 < len(blocks) else []
                if text.endswith(":") and heads:
                    text = f"{text} {'; '.join(heads)}."
                return title, text
        return title, ""
    return "", ""


def run_minutes(nb) -> float | None:
    """Minutes from the first cell's start to the last cell's reply (nbclient's timestamps), or None."""
    stamps = []
    for cell in nb.cells:
        ex = cell.get("metadata", {}).get("execution", {})
        for key in ("iopub.execute_input", "shell.execute_reply"):
            if key in ex:
                stamps.append(dt.datetime.fromisoformat(ex[key].replace("Z", "+00:00")))
    return (max(stamps) - min(stamps)).total_seconds() / 60 if len(stamps) >= 2 else None


def course_anchor(readme: Path) -> str:
    """README's course section as a GitHub link (its heading's anchor), or the README itself."""
    for line in readme.read_text().splitlines() if readme.exists() else []:
        m = re.match(r"#{2,4} (.*course.*)$", line, re.IGNORECASE)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            return f"{REPO_URL}#{slug}"
    return f"{REPO_URL}#readme"


def index_page(entries: list[dict], readme: Path) -> str:
    rows = []
    for e in entries:
        t = f"{e['minutes']:.1f} min" if e["minutes"] is not None else "not executed"
        num = e["src"].name.split("_")[0]  # the notebook's own number (00 is the first), as the README names it
        title = f"{e['title']} (appendix)" if num in APPENDIX else e["title"]
        rows.append(f"| {num} | [{title}]({e['src'].name}) | {e['objective']} | {t} |")
    total = sum(e["minutes"] or 0 for e in entries)
    return "\n".join(
        [
            "# labkit: PyTorch training on Cloud TPUs, from a notebook",
            "",
            "Read the notebooks in this order (" + " → ".join(COURSE) + "; the README says why); each builds on",
            "the ones before, and the last is an appendix. Every page is the notebook as it",
            "ran (fast mode on XLA:CPU: small data, a few dozen steps), with its printed output and its figures.",
            f"Open any of them in Colab from the [README]({REPO_URL}#readme) to run it yourself.",
            "",
            "**Objectives.** By the end you can train a model on a TPU through PyTorch/XLA and tell why it is fast",
            "or slow: lazy tensors and graphs, compiles and recompiles, host syncs, input pipelines that keep the",
            "chip busy, SPMD sharding over a mesh, checkpoints that survive preemption, and a model exported",
            "for serving on a CPU.",
            "",
            "| # | notebook | what you learn | run time here |",
            "|---|---|---|---|",
            *rows,
            "",
            f"Run time is what each notebook took when this book was built (fast mode; {total:.1f} min in all).",
            f"The time table for a class (reading, exercises, full-size runs) is in the README's "
            f"[course section]({course_anchor(readme)}).",
            "",
        ]
    )


def mkdocs_yml(entries: list[dict], docs: Path, site: Path) -> str:
    """The book's mkdocs.yml. Each title is written as a JSON string, which YAML reads as a double-quoted scalar: a
    backslash (a Windows path, LaTeX's `\\alpha`) or a quote in a notebook's title stays text, where it broke the
    file with a YAML error that named no notebook."""
    nav = "\n".join(f"  - {json.dumps(e['title'])}: {json.dumps(e['src'].name)}" for e in entries)
    return f"""site_name: labkit
docs_dir: {docs}
site_dir: {site}
use_directory_urls: false
theme:
  name: material
  font: false
nav:
  - Course: index.md
{nav}
plugins:
  - search
  - mkdocs-jupyter:
      execute: false
      include_source: false
"""


def build(notebooks: list[Path], executed: Path, out: Path) -> list[dict]:
    from mkdocs.commands.build import build as mkdocs_build
    from mkdocs.config import load_config

    entries = course(notebooks, executed)
    if not entries:
        raise SystemExit("no notebooks to put in the book (looked for notebooks/NN_*.ipynb)")
    with tempfile.TemporaryDirectory(prefix="labkit-book-") as tmp:
        docs = Path(tmp) / "docs"
        docs.mkdir()
        for e in entries:
            shutil.copy(e["copy"], docs / e["src"].name)
        (docs / "index.md").write_text(index_page(entries, ROOT / "README.md"))
        cfg = Path(tmp) / "mkdocs.yml"
        cfg.write_text(mkdocs_yml(entries, docs, out.resolve()))
        with contextlib.chdir(tmp):  # mkdocs-jupyter keeps a conversion cache in ./.cache: not in the checkout
            mkdocs_build(load_config(str(cfg)))
    return entries


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/NN_*.ipynb")
    ap.add_argument("--executed", type=Path, default=ROOT / "artifacts", help="where the executed copies are")
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "book")
    args = ap.parse_args()
    notebooks = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    entries = build(notebooks, args.executed, args.out)
    for e in entries:
        state = "executed" if e["executed"] else "NOT EXECUTED (source only)"
        print(f"[book] {e['src'].name}: {state}", flush=True)
    print(f"[book] {len(entries)} notebook(s) -> {args.out / 'index.html'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
