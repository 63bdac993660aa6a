"""labkit's version and the versions a checkpoint records: one source for both.

from labkit.versions import __version__, versions
versions()   # {'labkit': '0.1.0', 'torch': '2.9.0+cu128', 'torch_xla': '2.9.0'}
"""

from __future__ import annotations

from labkit.envsetup import VERSION as __version__  # the one home of the version


def versions() -> dict:
    """labkit, torch and (when installed) torch_xla versions, as strings."""
    import sys

    import torch

    out = {"labkit": __version__, "torch": str(torch.__version__)}
    # torch_xla's own __version__ when this run imported it; else (FSDP2 under torchrun, a GPU, or an import still
    # under way in another thread) the installed version from its metadata, ~15 ms. Importing it here cost 4.7 s on a
    # loaded 2-core machine, on the training thread at the first save (a save on SIGTERM has 30 s under torchrun), and
    # would set up an XLA runtime the run does not use
    from importlib import metadata

    v = getattr(sys.modules.get("torch_xla"), "__version__", None)
    if v is None:
        try:
            v = metadata.version("torch_xla")
        except metadata.PackageNotFoundError:
            pass
    if v is not None:
        out["torch_xla"] = str(v)
    return out
