"""Where checkpoints live: a local folder, gs://bucket/prefix or s3://bucket/prefix, behind one small interface.

    store = labkit.cloud.open_store("gs://bucket/run")   # LocalStore (here), GCSStore, S3Store (s3_store.py)
    store.acquire_writer()                           # one writer per root, before the first byte
    store.check_writer()                             # before each commit point: still ours, else RuntimeError
    store.put_if_absent("ckpt-00000100.pt", tmp_path, crc32c_b64)   # create-only; FileExistsError if taken
    store.list("step-"), store.get(name), store.put("manifest.json", b"...")  # put: overwrite, meant

Every store: labkit.cloud.protocol.VersionedStore (list / get / open / put_if_absent / put / delete / url, and
get_versioned / put_if_version, which labkit.checkpoint.pointer keeps `latest` with), local_path(name), the writer
lock (acquire_writer / check_writer / release_writer) and staging (temp_file / temp_dir / space_left).
Names are relative, "/" between folders. A path given to put* is moved in (local) or uploaded (gs://).

One writer per root. A folder: an flock on ROOT/.writer.lock (dropped by the kernel when the process
dies; opened without following a link, so a planted symlink is refused, never written through). A gs://
prefix: the object `.writer.lock`, created create-only (if_generation_match=0) before the first byte;
before every commit point (an object replaced, a marker, the pointer, a prune) the writer proves it
still holds it (check_writer: its generation is the one it wrote), and it deletes it on close only while
it is still its own. One left by a dead pid on this host is taken over, one from another host is
refused (nothing here can tell if that machine still runs) unless this run resumed or its lease ran
out on the server's clock. Checkpoint objects are create-only too: real GCS enforces it on every
upload, the loopback fake-gcs-server only on small (multipart) ones, hence the lock. An s3:// prefix does
the same with If-None-Match / If-Match on the ETag (labkit.cloud.s3_store).

Staging: a local store stages beside the target (a move is a rename), a GCS store in
<tmp>/labkit-ckpt/. Temp names carry the writer's pid and are swept only when it is gone (locally,
only by the lock holder), so opening a store never breaks another process's save.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import uuid

LOCK = ".writer.lock"
_TEMP = re.compile(r"^\..+\.(\d+)\.[^./]*\.tmp$")  # `.NAME.PID.RANDOM.tmp`: a file or a staging folder


def check_root(root) -> str:
    """`root` (a folder, gs://bucket/prefix or s3://bucket/prefix), or ValueError naming it when its path holds an
    empty, '.' or '..' segment (`gs://b/runs/../exp`, `a//b`, `c/./d`): object stores take such names literally,
    so a run would save under one name and a fresh manager look under another. Every store refuses them alike
    (data_tools refuses them in shard URLs); a folder may start with `./` or `../`, a trailing / is dropped."""
    text = str(root)
    scheme, sep, path = text.partition("://")
    if not sep:  # a folder: a leading / and a leading run of ./ ../ are ordinary relative paths
        path = re.sub(r"^/+", "", text)
        path = re.sub(r"^(?:\.\.?/+)+", "", path)
    else:
        path = path.partition("/")[2]  # the object path after the bucket
    segments = path.rstrip("/").split("/") if path.rstrip("/") else []
    bad = next((seg for seg in segments if seg in ("", ".", "..")), None)
    if bad is not None:
        from labkit.redact import redact

        raise ValueError(
            f"checkpoint root {redact(text)!r} holds {'an empty' if not bad else f'a {bad!r}'} path segment: "
            "give it without '//', '/./' or '/../' (object stores take them literally)"
        )
    return text


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` runs here. A number no pid can be (a stray `.x.99999999999999999999.y.tmp`, a lock body
    with a 13-digit pid) counts as alive: such a file or lock is left alone, never swept or taken over by pid."""
    if not 0 < pid < 2**31:  # os.kill would raise OverflowError (or signal a process group for 0 and below)
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _holder() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "id": uuid.uuid4().hex}


def _sweep(folder: str) -> None:
    """Remove the temp files and staging folders of writers whose process is gone."""
    for n in os.listdir(folder):
        m = _TEMP.match(n)
        if m and not _pid_alive(int(m.group(1))):
            p = os.path.join(folder, n)
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else _remove(p)


def _open_lock(path: str) -> int:
    """The lock file, opened without following a link: a `.writer.lock` planted as a symlink (or a hard
    link to another file) would otherwise have its target truncated and overwritten by the holder line."""
    import stat

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise RuntimeError(
                f"{path} is a symbolic link (to {os.readlink(path)!r}), not a lock file: refusing to write "
                "through it; remove the link"
            ) from None
        raise RuntimeError(f"cannot open the writer lock {path}: {e}") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise RuntimeError(
            f"{path} is not a plain lock file (a hard link, a device or a folder): refusing to write into it; remove it"
        )
    return fd


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class _Staging:
    """Temp files and folders named `.NAME.PID.RANDOM.tmp` under self._tmp (what _sweep recognises)."""

    _tmp: str

    def temp_file(self, name: str) -> str:
        fd, path = tempfile.mkstemp(prefix=f".{name.replace('/', '-')}.{os.getpid()}.", suffix=".tmp", dir=self._tmp)
        os.close(fd)
        return path

    def temp_dir(self, name: str) -> str:
        return tempfile.mkdtemp(prefix=f".{name.replace('/', '-')}.{os.getpid()}.", suffix=".tmp", dir=self._tmp)

    def space_left(self) -> tuple[str, int]:
        """(where the staging goes, MB free there): what a 'no space left' message names."""
        return self._tmp, shutil.disk_usage(self._tmp).free >> 20


_HELD_LOCKS: set = set()  # this process's writer-lock descriptors, closed in a forked child (_drop_inherited_locks)


def _drop_inherited_locks() -> None:
    """In a child made by fork (a DataLoader worker, persistent_workers=True): close the writer-lock descriptors it
    inherited. An flock belongs to the open file, which every copy of the descriptor shares: kept open by a worker,
    the lock outlived the manager's close() in the parent, and a new manager on the folder in the same notebook was
    refused as "another checkpoint writer", naming the parent itself."""
    for fd in list(_HELD_LOCKS):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_inherited_locks)


class LocalStore(_Staging):
    """A folder: a rename makes an object or the pointer appear atomically; os.link makes a
    create-only one (it fails if the name exists)."""

    def __init__(self, root):
        self.root = self._tmp = check_root(root)
        os.makedirs(self.root, exist_ok=True)
        self._lock_fd = None

    def url(self, name):
        return os.path.join(self.root, *name.split("/"))

    def local_path(self, name):
        return self.url(name)

    def acquire_writer(self, takeover: bool = False) -> None:  # takeover: see GCSStore's
        if self._lock_fd is not None:
            return
        try:
            import fcntl
        except ImportError:  # Windows: no advisory locks here; single-writer is then up to the user
            return
        fd = _open_lock(self.url(LOCK))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RuntimeError(
                f"{self.root} is being written by another checkpoint writer ({other}); two runs saving to one "
                "folder would delete each other's checkpoints. Use another folder, or close() the other manager"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()} pid {os.getpid()}".encode(), 0)
        self._lock_fd = fd
        _HELD_LOCKS.add(fd)
        _sweep(self.root)  # the lock is ours: temp files of dead writers can go (of a live one: never)

    def check_writer(self) -> None:
        """Before a commit point: the flock is held from acquire_writer to release_writer and no other
        process can take it over, so there is nothing to prove (GCSStore's proves its generation)."""

    def release_writer(self) -> None:
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            _HELD_LOCKS.discard(fd)
            os.close(fd)  # closing the descriptor drops the flock (no forked child holds a copy: _HELD_LOCKS)

    def _staged(self, name, src) -> str:
        if isinstance(src, bytes):  # small (a marker, the pointer): a temp file first, the same atomic move
            path = self.temp_file(name)
            with open(path, "wb") as f:
                f.write(src)
                f.flush()
                os.fsync(f.fileno())  # on disk before its name appears: a crash never shows an empty marker
            return path
        return str(src)

    def put_if_absent(self, name, src, crc=None):
        # the crc was computed from this very file by the caller; a re-read would checksum the page cache
        dst, path = self.url(name), self._staged(name, src)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            try:
                os.link(path, dst)  # create-only and atomic
            except FileExistsError:
                raise FileExistsError(f"{dst} already exists: another writer saved this name") from None
            except OSError:  # a file system without hard links (some FUSE mounts): check, then rename
                if os.path.exists(dst):
                    raise FileExistsError(f"{dst} already exists: another writer saved this name") from None
                os.replace(path, dst)
            _remove(path)  # moved in: the staged name goes
        finally:
            if isinstance(src, bytes):
                _remove(path)

    def put(self, name, src, crc=None):
        dst = self.url(name)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        path = self._staged(name, src)  # bytes: a fresh temp file (never a planted link), then one rename
        try:
            os.replace(path, dst)
        except BaseException:
            if isinstance(src, bytes):
                _remove(path)  # a full disk or Ctrl-C leaves no temp file behind
            raise

    def move(self, src, dst):
        target = self.url(dst)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(self.url(src), target)  # atomic on one file system; a missing src: FileNotFoundError
        self._drop_empty_parents(src)

    def get(self, name) -> bytes:
        with self.open(name) as f:
            return f.read()

    def open(self, name):
        return open(self.url(name), "rb")  # noqa: SIM115 -- the caller closes it (a context manager)

    def list(self, prefix: str = "") -> list[str]:
        out = []
        for folder, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if not _TEMP.match(d)]  # staging folders are not checkpoints
            rel = os.path.relpath(folder, self.root).replace(os.sep, "/")
            for n in files:
                name = n if rel == "." else f"{rel}/{n}"
                if name != LOCK and not _TEMP.match(n) and name.startswith(prefix):
                    out.append(name)
        return sorted(out)

    def delete(self, name):
        _remove(self.url(name))
        self._drop_empty_parents(name)

    def _drop_empty_parents(self, name):
        parent = os.path.dirname(self.url(name))
        while os.path.abspath(parent) != os.path.abspath(self.root):  # an emptied folder goes too
            try:
                os.rmdir(parent)
            except OSError:
                break
            parent = os.path.dirname(parent)

    def get_versioned(self, name):
        """Versions are not compared in a folder: its flock keeps every other writer out (version None)."""
        try:
            return self.get(name), None
        except FileNotFoundError:
            return None, None

    def put_if_version(self, name, data, version):
        self.put(name, data)
