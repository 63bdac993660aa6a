"""labkit's version and the versions a checkpoint records: one source for both.

from labkit.versions import __version__, versions
versions()   # {'labkit': '0.1.0', 'torch': '2.9.0+cu128', 'torch_xla': '2.9.0'}
"""

from __future__ import annotations

from labkit.envsetup import VERSION as __version__  # the one home of the version


def versions() -> dict:
    """labkit, torch and (when installed) torch_xla versions, as strings."""
    import torch

    out = {"labkit": __version__, "torch": str(torch.__version__)}
    try:
        import torch_xla

        out["torch_xla"] = str(torch_xla.__version__)
    except ImportError:
        pass
    return out
