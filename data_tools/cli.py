"""Command line: write one split of a source as tar shards + manifest.json.

    python -m data_tools --source digits --split train --out /tmp/digits/train --upsample 4
    python -m data_tools --source cifar10 --split val --out gs://my-bucket/cifar/val
(`python -m data_tools.shard ...` is the same command.) Errors are one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from .sources import SOURCES, SPLITS
from .urls import redact
from .writer import ENCODINGS, write_dataset


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def main(argv=None, prog: str = "python -m data_tools") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--source", choices=SOURCES, required=True)
    p.add_argument("--split", choices=SPLITS, required=True)
    p.add_argument("--out", required=True, help="local folder or gs://bucket/prefix (one per split)")
    p.add_argument("--upsample", type=_positive, default=1, help="repeat the train set K times (unique keys)")
    p.add_argument("--samples-per-shard", type=_positive, default=1000)
    p.add_argument("--max-shard-bytes", type=_positive, default=64 << 20)
    p.add_argument("--encoding", choices=ENCODINGS, default="png")
    p.add_argument("--cifar-path", default=None, help="folder with the CIFAR-10 python batches (offline)")
    p.add_argument("--num-synthetic", type=_positive, default=2000, help="train images for --source synthetic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    try:
        m = write_dataset(
            a.source,
            a.split,
            a.out,
            upsample=a.upsample,
            samples_per_shard=a.samples_per_shard,
            max_shard_bytes=a.max_shard_bytes,
            encoding=a.encoding,
            cifar_path=a.cifar_path,
            num_synthetic=a.num_synthetic,
            seed=a.seed,
            verbose=not a.quiet,
        )
    except (RuntimeError, OSError, ValueError) as e:  # OSError: missing/unwritable/unreachable output
        print(f"error: {redact(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"interrupted: {redact(a.out)} keeps its previous manifest and shards (or none, if publishing had begun)",
            file=sys.stderr,
        )
        return 130
    print(
        f"{m['num_samples']} samples in {len(m['shards'])} shards -> {redact(a.out)}/manifest.json "
        f"(mean {m['mean']}, std {m['std']})"
    )
    return 0
