"""Datasets as webdataset tar shards: write them (shards.py, CLI shard.py), stream them (stream.py).

    from data_tools import write_dataset, make_loader
    write_dataset("digits", "train", "/tmp/digits/train")
    train = make_loader("/tmp/digits/train/manifest.json", 64, train=True)
"""
from .shards import load_manifest, verify_manifest, write_dataset, write_shards
from .sources import load_source
from .stream import ShardError, ShardLoader, ShardStream, make_loader

__all__ = ["load_manifest", "verify_manifest", "write_dataset", "write_shards", "load_source",
           "ShardError", "ShardLoader", "ShardStream", "make_loader"]
