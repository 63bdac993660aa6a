"""Cloud storage: the one GCS client per process (sign-in, project, clear bucket errors), a real GCS-API
server on 127.0.0.1 for tests and offline runs, and the store interface (a local folder or a gs:// prefix)
that checkpoints and data_tools share. The only part of labkit that data_tools imports.

    from labkit.cloud import gcs, LocalGCSServer
"""

from labkit.cloud import gcs
from labkit.cloud.emulator import LocalGCSServer
from labkit.cloud.store import GCSStore, LocalStore, open_store
from labkit.envsetup import online  # can this machine reach the internet (datasets download or not)

__all__ = ["GCSStore", "LocalGCSServer", "LocalStore", "gcs", "online", "open_store"]
