"""Cloud storage: the one GCS client per process (sign-in, project, clear bucket errors), a real GCS-API
server on 127.0.0.1 for tests and offline runs, and the store interface (labkit.cloud.protocol: a local folder or a gs://
prefix) that checkpoints and data_tools share. The only part of labkit that data_tools imports.

    from labkit.cloud import gcs, LocalGCSServer
"""

from labkit.cloud import gcs
from labkit.cloud.emulator import LocalGCSServer
from labkit.cloud.gcs_store import GCSStore
from labkit.cloud.protocol import ObjectStore, ReadStore
from labkit.cloud.store import LocalStore
from labkit.envsetup import online  # can this machine reach the internet (datasets download or not)


def open_store(root, retry_deadline_s: float = 60):
    """The store for `root`: GCSStore for gs://..., LocalStore for a folder (labkit.cloud.store's interface)."""
    return GCSStore(str(root), retry_deadline_s) if gcs.is_gcs(str(root)) else LocalStore(root)


__all__ = ["GCSStore", "LocalGCSServer", "LocalStore", "ObjectStore", "ReadStore", "gcs", "online", "open_store"]
