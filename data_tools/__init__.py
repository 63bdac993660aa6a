"""Datasets as webdataset tar shards: write them (writer.py, command line cli.py), describe them
(manifest.py), open any URL (urls.py), stream them (stream.py, loader.py).

    from data_tools import write_dataset, make_loader
    write_dataset("digits", "train", "/tmp/digits/train")
    train = make_loader("/tmp/digits/train/manifest.json", 64, train=True)

    python -m data_tools --source digits --split train --out /tmp/digits/train
"""

from .loader import ShardLoader, make_loader
from .manifest import ShardError, load_manifest, verify_manifest
from .sources import load_source
from .stream import ShardStream
from .urls import open_url, register_scheme
from .writer import write_dataset, write_shards

__all__ = [
    "load_manifest",
    "verify_manifest",
    "write_dataset",
    "write_shards",
    "load_source",
    "open_url",
    "register_scheme",
    "ShardError",
    "ShardLoader",
    "ShardStream",
    "make_loader",
]
