"""The small builder both notebook scripts use: collect markdown/code cells, write them without outputs.

    from nbcells import Cells
    nb = Cells()
    nb.md("# Title")
    nb.code("x = 1", tags=["parameters"])
    nb.write("01_example.ipynb")             # into notebooks/, stable cell ids, Colab metadata
"""
from pathlib import Path

import nbformat as nbf

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


class Cells:
    def __init__(self):
        self.cells = []

    def md(self, text: str) -> None:
        self.cells.append(nbf.v4.new_markdown_cell(text.strip()))

    def code(self, text: str, tags=None) -> None:
        c = nbf.v4.new_code_cell(text.strip())
        if tags:
            c.metadata["tags"] = list(tags)
        self.cells.append(c)

    def write(self, name: str) -> Path:
        nb = nbf.v4.new_notebook()
        for i, c in enumerate(self.cells):
            c["id"] = f"cell-{i:02d}"  # stable ids: regenerating gives a clean diff
        nb.cells = self.cells
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        nb.metadata["accelerator"] = "TPU"
        nb.metadata["colab"] = {"provenance": []}
        out = NOTEBOOKS / name
        nbf.write(nb, out)
        print("wrote", out)
        return out
