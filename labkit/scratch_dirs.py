"""Scratch folders that do not pile up: one per notebook run, removed once that run's process has ended.

A notebook that writes a dataset, an exported model or a checkpoint "somewhere temporary" with
`tempfile.mkdtemp()` leaves it behind: run it ten times and /tmp holds ten copies (notebook 05's
stand-in ResNet and its exports are about 100 MB a run). `scratch(name)` gives a fresh folder,
`<base>/labkit-<name>-<pid>-<random>`, and first removes the folders of earlier runs whose process is
gone. The folder of the kernel that is running stays, so you can look at what it wrote.

base is $LABKIT_SCRATCH, else the system's temp folder. Only folders that carry the marker file this
module writes are ever removed, so nothing else under base is touched.
"""

import os
import shutil
import tempfile
from pathlib import Path

MARKER = ".labkit-scratch"  # holds the pid of the process that made the folder


def base() -> Path:
    """Where scratch folders go: $LABKIT_SCRATCH, else the system's temp folder."""
    return Path(os.environ.get("LABKIT_SCRATCH") or tempfile.gettempdir())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not ours to clean
        return True
    return True


def sweep(name: str = "*") -> list[str]:
    """Remove scratch folders (of `name`, or all) whose process has ended; return what was removed."""
    removed = []
    for folder in base().glob(f"labkit-{name}-*"):
        marker = folder / MARKER
        try:
            pid = int(marker.read_text().strip())
        except (OSError, ValueError):  # not a scratch folder (or not ours): leave it
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(str(folder))
    return removed


def scratch(name: str) -> str:
    """A new empty folder for this run's files (see the module's docstring); its path as a string."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"scratch name {name!r}: use a plain name such as '05' or 'photos'")
    sweep(name)
    root = base()
    root.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"labkit-{name}-{os.getpid()}-", dir=root))
    (folder / MARKER).write_text(str(os.getpid()))
    return str(folder)
