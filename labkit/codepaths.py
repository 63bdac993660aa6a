"""Whose code is a file? labkit's, torch's, or the learner's: decided by where the package really lives (its
`__file__`, resolved), never by a substring of a path. A clone of this project is a folder named `labkit`, so
"/labkit/" appears in the path of every file in it, the learner's and the tests' included; a Google Drive folder
on Colab (`/content/drive/My Drive/...`) holds spaces. Both are ordinary paths here.

    from labkit.codepaths import LABKIT_DIR, is_labkit_file, under
    is_labkit_file(frame.f_code.co_filename)    # True only inside the installed labkit package
    under(path, os.path.dirname(torch.__file__)) # inside that folder (resolved; a sibling folder with a longer name is not)
"""

from __future__ import annotations

import os

LABKIT_DIR = os.path.dirname(os.path.realpath(__file__))  # the package folder itself, not the clone around it


def _real(path: str) -> str:
    return os.path.normcase(os.path.realpath(path))


def under(path: str, *folders: str) -> bool:
    """Whether `path` resolves to a file inside one of `folders` (each resolved too). Pseudo-files such as
    "<ipython-input-3>" or "<frozen runpy>" are inside no folder."""
    if not path or path.startswith("<"):
        return False
    real = _real(path)
    for folder in folders:
        root = _real(folder)
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return True
    return False


def is_labkit_file(path: str) -> bool:
    """Whether `path` is a file of the labkit package (its modules, lessons and checkers), wherever it is installed."""
    return under(path, LABKIT_DIR)
