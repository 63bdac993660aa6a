"""scripts/build_book.py's mkdocs.yml reads back as YAML whatever a notebook's title holds."""

import importlib.util
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_a_title_with_a_backslash_or_quotes_stays_text_in_mkdocs_yml(tmp_path):
    spec = importlib.util.spec_from_file_location("build_book", ROOT / "scripts" / "build_book.py")
    book = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(book)
    titles = [r"Reading C:\data\new and $\alpha$", 'A "quoted" word: and a colon', "Plain"]
    entries = [{"title": t, "src": Path(f"{i:02d}_x.ipynb")} for i, t in enumerate(titles)]
    cfg = yaml.safe_load(book.mkdocs_yml(entries, tmp_path / "docs", tmp_path / "site"))
    assert cfg["nav"][1:] == [{t: f"{i:02d}_x.ipynb"} for i, t in enumerate(titles)], cfg["nav"]
