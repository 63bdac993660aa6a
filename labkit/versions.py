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
    xla = sys.modules.get("torch_xla")
    if xla is not None:
        out["torch_xla"] = str(xla.__version__)
        return out
    # not imported by this run (FSDP2 under torchrun, a GPU): its installed version from its metadata, ~15 ms.
    # Importing it here cost 4.7 s on a loaded 2-core machine, on the training thread at the first save (a save
    # on SIGTERM has 30 s under torchrun), and would set up an XLA runtime the run does not use
    from importlib import metadata

    try:
        out["torch_xla"] = metadata.version("torch_xla")
    except metadata.PackageNotFoundError:
        pass
    return out
