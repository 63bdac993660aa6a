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

# The Colab set-up cell, the same in every notebook: it must run before labkit exists, so it
# cannot live in labkit. Expects `Params` from the parameters cell; re-reads P after installing.
COLAB_SETUP = '''
import importlib.util, subprocess

IN_COLAB = "google.colab" in sys.modules
if IN_COLAB and importlib.util.find_spec("labkit") is None:
    on_tpu = bool(os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("COLAB_TPU_ADDR") or os.path.exists("/dev/accel0"))
    pkgs = ["torch==2.9.0", "torchvision==0.24.0"] + (["torch_xla[tpu]==2.9.0"] if on_tpu else [])
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *pkgs,
                    "labkit @ git+https://github.com/labkit/labkit"], check=True)
    import labkit
    P = labkit.from_env(Params)
import labkit

print("labkit", labkit.__version__, "from", os.path.dirname(labkit.__file__))
'''


def colab_badge(name: str) -> str:
    """The "Open in Colab" badge for notebooks/<name>."""
    return ("[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            f"(https://colab.research.google.com/github/labkit/labkit/blob/main/notebooks/{name})")


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
