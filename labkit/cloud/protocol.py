"""The one declared object-store interface: what checkpoints and data_tools ask of a place to keep bytes.

    from labkit.cloud.protocol import ObjectStore, ReadStore
    assert isinstance(labkit.cloud.open_store("gs://bucket/run"), ObjectStore)

Names are relative to the store's root, "/" between folders. Writable (VersionedStore): a local folder
(labkit.cloud.store.LocalStore), a gs:// prefix (labkit.cloud.gcs_store.GCSStore) and an s3:// prefix
(labkit.cloud.s3_store.S3Store: AWS S3 or an S3-compatible server). Read-only: any URL prefix that
data_tools.urls opens (file, gs://, s3://, http(s)://: data_tools.url_store.URLStore); http(s) stays read-only.

`runtime_checkable` checks only that the methods exist; tests/test_store_protocol.py checks what they do
(put_if_absent refuses a taken name on every writable store).
"""

from __future__ import annotations

import os
from typing import BinaryIO, Protocol, runtime_checkable

Source = bytes | str | os.PathLike  # bytes, or a local file that is moved in (folder) or uploaded (gs://, s3://)


@runtime_checkable
class ReadStore(Protocol):
    """Reading only: an http(s) prefix, a bucket one may not write."""

    def url(self, name: str) -> str:
        """Where `name` lives, as a person or another tool would open it."""
        ...

    def get(self, name: str) -> bytes:
        """The whole object; FileNotFoundError naming it when there is none."""
        ...

    def open(self, name: str) -> BinaryIO:
        """A streaming binary file object (a context manager); FileNotFoundError for a missing object, at the
        latest on the first read (GCS learns it then)."""
        ...


@runtime_checkable
class ObjectStore(ReadStore, Protocol):
    """Reading and writing. A put is atomic: a reader sees the old object or the whole new one, never a part."""

    def list(self, prefix: str = "") -> list[str]:
        """Sorted names starting with `prefix` (the store's own lock and staging files are not listed)."""
        ...

    def put_if_absent(self, name: str, src: Source, crc: str | None = None) -> None:
        """Create only: FileExistsError when `name` exists (two writers never replace each other's object).
        `crc` (base64 crc32c of src) lets a remote store verify the upload and recognise its own retried one."""
        ...

    def put(self, name: str, src: Source, crc: str | None = None) -> None:
        """Create or replace, meant (a manifest, a pointer)."""
        ...

    def delete(self, name: str) -> None:
        """Remove `name`; a missing one is no error."""
        ...

    def move(self, src: str, dst: str) -> None:
        """Rename `src` to `dst`, replacing it: a rename in a folder (atomic); on gs:// and s3:// a copy made by
        the server (no bytes through this host) and then a delete of `src`. FileNotFoundError for a missing src."""
        ...


class VersionConflict(RuntimeError):
    """put_if_version found another version than the one it was told to replace."""


@runtime_checkable
class VersionedStore(ObjectStore, Protocol):
    """An object replaced only if unchanged since it was read (the checkpoint `latest` pointer)."""

    def get_versioned(self, name: str) -> tuple[bytes | None, object]:
        """(bytes or None when there is none, the version to pass to put_if_version)."""
        ...

    def put_if_version(self, name: str, data: bytes, version: object) -> object:
        """Replace `name` only if it is still at `version` (VersionConflict otherwise); the new version."""
        ...


__all__ = ["ObjectStore", "ReadStore", "Source", "VersionConflict", "VersionedStore"]
