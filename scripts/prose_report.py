"""How the course's prose reads: words a sentence, long sentences, long paragraphs, stacked parentheticals.

    python scripts/prose_report.py                          # every notebook, then the course's totals
    python scripts/prose_report.py notebooks/01_*.py -v     # one notebook, with its worst sentences and paragraphs

It reads the markdown cells of the notebooks' py:percent sources. Headings, tables, code blocks, block quotes
and HTML are left out; a `code span` counts as one word. A sentence ends at . ! or ? followed by a space and
a capital, a backtick, a digit or an opening mark, or at the end of a paragraph. A list item is a paragraph
of its own. The targets (a mean of at most 20 words a sentence, at most 5 % of sentences over 35 words, no
paragraph over 120 words, no sentence with two parentheticals) are a report, not a gate: the unit test
prints this report and checks only that it measures what it says.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
TARGETS = {"mean_words": 20.0, "share_over_35": 0.05, "paragraph_words": 120, "parentheticals": 1}

_CODE_SPAN = re.compile(r"`[^`\n]+`")
_LINK = re.compile(r"\[([^\]]+)\]\([^)]+\)")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]*_]*\s+(?=[A-Z0-9`\"'(*_\[])")
_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")


@dataclass
class Report:
    name: str
    sentences: list[str] = field(default_factory=list)
    paragraphs: list[str] = field(default_factory=list)

    @staticmethod
    def words(text: str) -> int:
        return len(_CODE_SPAN.sub("CODE", text).split())

    def counts(self) -> dict:
        lengths = [self.words(s) for s in self.sentences]
        n = max(len(lengths), 1)
        return {
            "words": sum(self.words(p) for p in self.paragraphs),
            "sentences": len(lengths),
            "mean_words": sum(lengths) / n,
            "share_over_35": sum(x > 35 for x in lengths) / n,
            "paragraphs_over_120": sum(self.words(p) > 120 for p in self.paragraphs),
            "two_parentheticals": sum(parentheticals(s) >= 2 for s in self.sentences),
        }


def parentheticals(sentence: str) -> int:
    """Opening parentheses outside code spans and links' targets."""
    return _LINK.sub(r"\1", _CODE_SPAN.sub("CODE", sentence)).count("(")


def markdown_cells(src: Path) -> list[str]:
    """The markdown cells of a py:percent notebook source, with their leading '# ' taken off."""
    cells, current = [], None
    for line in src.read_text().splitlines():
        if line.startswith("# %%"):
            if current is not None:
                cells.append("\n".join(current))
            current = [] if "[markdown]" in line else None
        elif current is not None:
            current.append(line[2:] if line.startswith("# ") else line.lstrip("#"))
    if current is not None:
        cells.append("\n".join(current))
    return cells


def prose_paragraphs(markdown: str) -> list[str]:
    """Paragraphs of running prose: headings, tables, fenced code, quotes and HTML left out; list items split."""
    out, block, fenced = [], [], False

    def flush():
        if block:
            out.append(" ".join(block))
            block.clear()

    for line in markdown.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fenced = not fenced
            flush()
            continue
        if fenced or stripped.startswith(("#", "|", ">", "<")) or not stripped:
            flush()
            continue
        if _ITEM.match(line):
            flush()
            line = _ITEM.sub("", line)
        block.append(line.strip())
    flush()
    return [p for p in out if Report.words(p) > 0]


def split_sentences(paragraph: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(paragraph) if Report.words(s) > 0]


def read(src: Path) -> Report:
    rep = Report(src.stem)
    for cell in markdown_cells(src):
        for p in prose_paragraphs(cell):
            rep.paragraphs.append(p)
            rep.sentences.extend(split_sentences(p))
    return rep


def merge(reports: list[Report], name: str = "course") -> Report:
    total = Report(name)
    for r in reports:
        total.sentences += r.sentences
        total.paragraphs += r.paragraphs
    return total


def line(c: dict, name: str) -> str:
    return (
        f"{name:<34} {c['words']:>6} words  {c['sentences']:>5} sentences  mean {c['mean_words']:5.1f}  "
        f"over 35: {100 * c['share_over_35']:4.1f} %  paragraphs over 120: {c['paragraphs_over_120']:>3}  "
        f"two parentheticals: {c['two_parentheticals']:>3}"
    )


def meets(c: dict) -> bool:
    return (
        c["mean_words"] <= TARGETS["mean_words"]
        and c["share_over_35"] <= TARGETS["share_over_35"]
        and c["paragraphs_over_120"] == 0
        and c["two_parentheticals"] == 0
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="*", type=Path)
    ap.add_argument("-v", "--verbose", action="store_true", help="list the long sentences and paragraphs")
    args = ap.parse_args(argv)
    sources = args.sources or sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
    reports = [read(s) for s in sources]
    for r in reports:
        print(line(r.counts(), r.name))
        if args.verbose:
            for s in r.sentences:
                if Report.words(s) > 35 or parentheticals(s) >= 2:
                    print(f"    [{Report.words(s)} words, {parentheticals(s)} parens] {s}")
            for p in r.paragraphs:
                if Report.words(p) > 120:
                    print(f"    [paragraph of {Report.words(p)} words] {p[:100]}...")
    total = merge(reports).counts()
    print(line(total, "all"))
    print(
        "targets: mean <= 20, over 35 <= 5 %, no paragraph over 120, no sentence with two parentheticals:",
        "met" if meets(total) else "not met",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
