"""First training step with torch_xla's persistent compile cache: a cold process vs a warm one.

    PJRT_DEVICE=CPU .venv/bin/python bench/bench_compile_cache.py [--model resnet50] [--trials 2]

Each trial empties a cache folder, then runs two fresh processes on it one after the other
(labkit.lessons.compile_cache_demo.first_step_in_child): the cold one compiles and writes the programs, the warm one
finds them. A third process with the cache off is the baseline. Prints, per trial, the first step's
wall time, XLA compile time and compiles, and the PersistentCache* counters, then warm/cold ratios.

On a TPU the warm process loads the executables (PersistentCacheHit) and its first step skips compiling.
On XLA:CPU torch_xla 2.9 writes the files but cannot deserialise them (PersistentCacheDeserializeFailure):
the warm process compiles again, so the ratio stays near 1 and shows only the noise of the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

os.environ.setdefault("PJRT_DEVICE", "CPU")

from labkit.lessons.compile_cache_demo import MODELS, first_step_in_child


def _row(name: str, r: dict) -> str:
    c = {k.replace("PersistentCache", ""): v for k, v in r["counters"].items() if v}
    return (
        f"  {name:5s} first step {r['first_step_s']:7.2f} s  compile {r['compile_s']:7.2f} s "
        f"({r['compiles']} graphs)  cache files {len(r['entries'])}  counters {c or '-'}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet50", choices=MODELS)
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--backend", default=None, help="tpu or xla-cpu (default: what labkit.setup() picks)")
    a = ap.parse_args()
    ratios, compile_ratios = [], []
    for trial in range(a.trials):
        with tempfile.TemporaryDirectory() as d:
            folder = os.path.join(d, "xla-cache")
            cold = first_step_in_child(folder, a.model, a.backend)
            warm = first_step_in_child(folder, a.model, a.backend)
        off = first_step_in_child(None, a.model, a.backend)
        print(f"trial {trial + 1} ({a.model}):")
        for name, r in (("off", off), ("cold", cold), ("warm", warm)):
            print(_row(name, r))
        ratios.append(warm["first_step_s"] / cold["first_step_s"])
        compile_ratios.append(warm["compile_s"] / max(cold["compile_s"], 1e-9))
    print(
        f"warm/cold first step: {' '.join(f'{r:.2f}' for r in ratios)} (median {statistics.median(ratios):.2f}); "
        f"compile time: {' '.join(f'{r:.2f}' for r in compile_ratios)} (median {statistics.median(compile_ratios):.2f})"
    )


if __name__ == "__main__":
    main()
