"""Cloud storage: the one GCS client per process (sign-in, project, clear bucket errors), a real GCS-API
server on 127.0.0.1 for tests and offline runs, and the store interface (labkit.cloud.protocol: a local folder, a gs://
prefix or an s3:// one) that checkpoints and data_tools share. The only part of labkit that data_tools imports.

    from labkit.cloud import gcs, LocalGCSServer
"""

from labkit.cloud import gcs
from labkit.cloud.emulator import LocalGCSServer
from labkit.cloud.gcs_store import GCSStore
from labkit.cloud.protocol import ObjectStore, ReadStore
from labkit.cloud.s3_store import S3Store, is_s3
from labkit.cloud.store import LocalStore
from labkit.envsetup import online  # can this machine reach the internet (datasets download or not)


def open_store(root, retry_deadline_s: float = 60):
    """The store for `root`: GCSStore for gs://..., S3Store for s3://..., LocalStore for a folder
    (labkit.cloud.protocol's VersionedStore, each)."""
    if gcs.is_gcs(str(root)):
        return GCSStore(str(root), retry_deadline_s)
    if is_s3(root):
        return S3Store(str(root), retry_deadline_s)
    return LocalStore(root)


__all__ = [
    "GCSStore",
    "LocalGCSServer",
    "LocalStore",
    "ObjectStore",
    "ReadStore",
    "S3Store",
    "gcs",
    "online",
    "open_store",
]
