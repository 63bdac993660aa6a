"""Tar member parsing: data_tools.tario.iter_tar vs Python's tarfile, per member, beside a PNG decode.

    .venv/bin/python bench/bench_tario.py [--samples 2000] [--trials 5]

One real shard as the writer makes it (scikit-learn digits, 32x32 PNG + cls: two members per
sample), held in memory so that only parsing is timed. Three readers of the same bytes:
tarfile in stream mode ("r|", what a reader of a gs:// or http stream must use), tarfile with
random access ("r:"), and iter_tar (data_tools.tario). Each reads every member's bytes. The 32x32
PNG decode (data_tools.transforms.decode_image) is timed too, as the yardstick: a reader that
costs more per sample than the decode is the bottleneck of the loader. Best of --trials
(the minimum is the least disturbed by other processes on a shared machine); ratios printed.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tarfile
import tempfile
import time

from data_tools import load_source, write_shards
from data_tools.tario import iter_tar
from data_tools.transforms import decode_image


def best(fn, trials: int) -> float:
    out = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--trials", type=int, default=5)
    a = p.parse_args(argv)
    x, y, names = load_source("digits", "train")
    x, y = x[: a.samples], y[: a.samples]
    with tempfile.TemporaryDirectory() as tmp:
        m = write_shards(x, y, tmp, class_names=names, samples_per_shard=len(x))
        with open(os.path.join(tmp, m["shards"][0]["name"]), "rb") as f:
            raw = f.read()
    members = 2 * len(x)

    def stream_mode():
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r|") as tf:
            for ti in tf:
                tf.extractfile(ti).read()

    def random_access():
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
            for ti in tf.getmembers():
                tf.extractfile(ti).read()

    def ours():
        for _ in iter_tar(io.BytesIO(raw)):
            pass

    pngs = [data for name, data in iter_tar(io.BytesIO(raw)) if name.endswith(".png")][:500]

    def decode():
        for d in pngs:
            decode_image(d)

    n = sum(1 for _ in iter_tar(io.BytesIO(raw)))
    assert n == members, (n, members)
    us = {
        k: best(fn, a.trials) / members * 1e6
        for k, fn in (
            ("tarfile r| (stream)", stream_mode),
            ("tarfile r: (random access)", random_access),
            ("iter_tar", ours),
        )
    }
    dec = best(decode, a.trials) / len(pngs) * 1e6
    print(
        f"one shard of {len(x)} samples ({members} members, {len(raw) / 1e6:.1f} MB) in memory; "
        f"best of {a.trials}; cpus={os.cpu_count()}"
    )
    for k, v in us.items():
        print(f"  {k:<28} {v:7.1f} us/member")
    print(f"  32x32 PNG decode             {dec:7.1f} us/image")
    print("ratios:")
    print(f"  tarfile stream / iter_tar    {us['tarfile r| (stream)'] / us['iter_tar']:6.1f}x")
    print(f"  tarfile random / iter_tar    {us['tarfile r: (random access)'] / us['iter_tar']:6.1f}x")
    print(
        f"  tarfile stream per sample / PNG decode  {2 * us['tarfile r| (stream)'] / dec:5.2f}x   "
        f"iter_tar per sample / PNG decode  {2 * us['iter_tar'] / dec:5.2f}x"
    )


if __name__ == "__main__":
    sys.exit(main())
