"""INT8 (x86, PT2E + Inductor) vs float32 ResNet-50 on this CPU: throughput ratios and the accuracy cost.

    python bench/bench_int8.py [--checkpoint checkpoints/resnet50_cifar.pt] [--calib 512] [--seconds 3]

Uses notebook 01's serving checkpoint (labkit.serve.export.artifacts_dir()/resnet50_cifar.pt) and its validation
shards; without one it trains the CPU stand-in (labkit.serve.export.stand_in_resnet) first and says so. Prints, from
one run with every model measured on the same cores one after another: images/s for fp32 eager, fp32 compiled
and int8 compiled at each batch size, compile times, validation accuracy of each, sizes of the exported
programs, the CPU's int8 flags, and the ratios int8/fp32 (throughput) and int8 - fp32 (accuracy).
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from data_tools import load_manifest, make_loader  # noqa: E402
from labkit.serve import export, quantize  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=str(export.artifacts_dir() / "resnet50_cifar.pt"))
    ap.add_argument("--calib", type=int, default=512, help="training images for calibration")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per measurement")
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()

    flags = quantize.cpu_flags()
    print(f"CPU: {flags['model']}, torch threads {torch.get_num_threads()}, torch {torch.__version__}")
    print("flags:", " ".join(f"{k}={int(flags[k])}" for k in quantize.INT8_FLAGS))
    print("expect:", quantize.int8_outlook(flags))
    path = args.checkpoint
    if not os.path.exists(path):
        print(f"no checkpoint at {path}: training the CPU STAND-IN (accuracy far below a real run)")
        path = export.stand_in_resnet(tempfile.mkdtemp(prefix="bench-int8-"))
    model, ckpt = export.load_model(path)
    meta = ckpt["meta"]
    val_url = meta["val"]
    if val_url.startswith("gs://labkit-local/"):
        from labkit.cloud.emulator import LocalGCSServer

        LocalGCSServer(root=os.path.abspath("notebooks/data/local-gcs")).start()
    load_manifest(val_url)
    val = make_loader(val_url, 32, train=False, mean=meta["mean"], std=meta["std"])
    train_url = val_url.replace("/val/manifest.json", "/train/manifest.json")
    calib = []
    for x, _ in make_loader(train_url, 32, train=False, mean=meta["mean"], std=meta["std"]):
        calib.append(x)
        if 32 * len(calib) >= args.calib:
            break
    x32 = next(iter(val))[0]
    t0 = time.perf_counter()
    q = quantize.quantize_x86(model, x32[:4], calib)
    print(f"quantized with {quantize.pt2e_api()[-1]} on {32 * len(calib)} images in {time.perf_counter() - t0:.0f} s")
    sizes = {"fp32": quantize.size_on_disk(export.export(model, x32[:4])), "int8": quantize.size_on_disk(q, x32[:4])}

    batches = [int(b) for b in args.batches.split(",")]
    xb = {b: torch.cat([x32] * (1 + b // 32))[:b] for b in batches}
    runs = {"fp32 eager": model}
    for name, m in (("fp32 compiled", model), ("int8 compiled", q)):
        t0 = time.perf_counter()
        runs[name] = quantize.compile_cpu(m, xb[batches[-1]])
        for b in batches[:-1]:
            runs[name](xb[b])
        print(f"{name}: compile for batches {batches}: {time.perf_counter() - t0:.0f} s")
    speed = {n: {b: quantize.throughput(fn, xb[b], seconds=args.seconds) for b in batches} for n, fn in runs.items()}
    acc = {n: export.evaluate(fn, val)["val_acc"] for n, fn in runs.items()}
    print(f"\n{'model':14s} " + " ".join(f"{'b' + str(b) + ' img/s':>10s}" for b in batches) + "   val acc  size MB")
    for n in runs:
        size = sizes["int8" if n.startswith("int8") else "fp32"] / 1e6
        print(f"{n:14s} " + " ".join(f"{speed[n][b]:10.1f}" for b in batches) + f"  {acc[n]:7.2%}  {size:7.1f}")
    print()
    for b in batches:
        print(
            f"batch {b:3d}: int8/fp32-compiled {speed['int8 compiled'][b] / speed['fp32 compiled'][b]:.2f}x, "
            f"int8/fp32-eager {speed['int8 compiled'][b] / speed['fp32 eager'][b]:.2f}x, "
            f"fp32 compiled/eager {speed['fp32 compiled'][b] / speed['fp32 eager'][b]:.2f}x"
        )
    print(
        f"accuracy int8 - fp32: {(acc['int8 compiled'] - acc['fp32 eager']) * 100:+.2f} points; "
        f"size fp32/int8 {sizes['fp32'] / sizes['int8']:.2f}x"
    )


if __name__ == "__main__":
    main()
