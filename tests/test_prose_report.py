"""The course's prose report (scripts/prose_report.py): it measures what it says, and prints the course's figures.

A report, not a gate: the targets are printed with the figures, and only the measuring is asserted."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("prose_report", ROOT / "scripts" / "prose_report.py")
prose = importlib.util.module_from_spec(spec)
sys.modules["prose_report"] = prose  # its dataclass looks its module up
spec.loader.exec_module(prose)

SOURCE = """# %% [markdown]
# # A heading is left out
#
# One short sentence. A `code span with words` counts as one word! Is (this) one (or two)?
#
# | a table | is left out |
# |---|---|
#
# - A list item is a paragraph.
# - So is this one.

# %%
x = 1  # code is left out

# %% [markdown]
# ```python
# also_left_out = True
# ```
# > So is a quote.
"""


def test_it_counts_what_it_says(tmp_path):
    src = tmp_path / "00_probe.py"
    src.write_text(SOURCE)
    rep = prose.read(src)
    assert rep.paragraphs[0].startswith("One short sentence.") and len(rep.paragraphs) == 3
    assert [prose.Report.words(s) for s in rep.sentences] == [3, 6, 5, 6, 4]
    c = rep.counts()
    assert c["sentences"] == 5 and c["two_parentheticals"] == 1 and c["paragraphs_over_120"] == 0
    assert c["mean_words"] == 24 / 5 and c["share_over_35"] == 0
    long = tmp_path / "01_long.py"
    long.write_text("# %% [markdown]\n# " + " ".join(["word"] * 121) + ".\n")
    c = prose.read(long).counts()
    assert c["paragraphs_over_120"] == 1 and c["share_over_35"] == 1.0 and not prose.meets(c)


def test_the_course_report(capsys):
    assert prose.main([]) == 0
    out = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + out)
    assert out.count(" words ") == len(list((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))) + 1
