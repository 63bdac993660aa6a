"""Command line: write one split of a source as tar shards + manifest.json.

    python -m data_tools.shard --source digits --split train --out /tmp/digits/train --upsample 4
    python -m data_tools.shard --source cifar10 --split val --out gs://my-bucket/cifar/val
"""
from __future__ import annotations

import argparse
import sys

from .shards import ENCODINGS, write_dataset
from .sources import SOURCES, SPLITS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m data_tools.shard", description=__doc__.splitlines()[0])
    p.add_argument("--source", choices=SOURCES, required=True)
    p.add_argument("--split", choices=SPLITS, required=True)
    p.add_argument("--out", required=True, help="local folder or gs://bucket/prefix (one per split)")
    p.add_argument("--upsample", type=int, default=1, help="repeat the train set K times (unique keys)")
    p.add_argument("--samples-per-shard", type=int, default=1000)
    p.add_argument("--max-shard-bytes", type=int, default=64 << 20)
    p.add_argument("--encoding", choices=ENCODINGS, default="png")
    p.add_argument("--cifar-path", default=None, help="folder with the CIFAR-10 python batches (offline)")
    p.add_argument("--num-synthetic", type=int, default=2000, help="train images for --source synthetic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    try:
        m = write_dataset(a.source, a.split, a.out, upsample=a.upsample, samples_per_shard=a.samples_per_shard,
                          max_shard_bytes=a.max_shard_bytes, encoding=a.encoding, cifar_path=a.cifar_path,
                          num_synthetic=a.num_synthetic, seed=a.seed, verbose=not a.quiet)
    except (RuntimeError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{m['num_samples']} samples in {len(m['shards'])} shards -> {a.out}/manifest.json "
          f"(mean {m['mean']}, std {m['std']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
