"""Cost of checkpointing while training: ResNet-50 (batch 8, 32x32) on XLA:CPU, saving to a
loopback GCS server.

    PJRT_DEVICE=CPU python bench/bench_checkpoint.py [--steps 36]

Prints, from one run: the mean step time of steps that overlap a background upload divided
by the mean of steps that do not (goal <= 1.05), the time the save() call itself blocks the
step (the one batched device->host copy), whether saving compiled anything, and the save
throughput (to_cpu + torch.save + crc32c + verified upload + pointer) against a plain
blob.upload_from_filename of the same bytes. On a 2-core machine the upload thread competes
with XLA's compute threads for CPU, so the overlap ratio here is an upper bound of a TPU host's.

    PJRT_DEVICE=CPU python bench/bench_checkpoint.py --pin     # what a TPU host sees

--pin gives training and the writer separate cores, as on a TPU host, where the step runs on the
chip and the host's other cores are free: the process (XLA:CPU's thread pool, created after this)
on core 0, the upload thread and the loopback GCS server on core 1. Also printed: host CPU-seconds
per GB saved (the writer thread's CPU time + the copy save() does in the step).
"""

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch
import torchvision

import labkit
from labkit.checkpoint import CheckpointManager
from labkit.cloud import gcs
from labkit.cloud.emulator import LocalGCSServer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=44)
    ap.add_argument("--save-at", type=int, nargs="+", default=[8, 26])
    ap.add_argument("--pin", action="store_true", help="training on core 0, writer and server on core 1")
    a = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    train_cpus, writer_cpus = ({cpus[0]}, set(cpus[1:2])) if a.pin and len(cpus) > 1 else (set(cpus), set(cpus))
    if a.pin:
        if len(cpus) < 2:
            raise SystemExit("--pin needs two cores")
        # the calling thread's affinity; every thread started from here on (XLA's pool, torch's) inherits it
        os.sched_setaffinity(0, train_cpus)
        torch.set_num_threads(len(train_cpus))
    print(f"cores: training {sorted(train_cpus)}, writer and server {sorted(writer_cpus)}")
    import torch_xla.debug.metrics as met

    rt = labkit.setup("xla-cpu")
    rt.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(8 * a.steps, 3, 32, 32), torch.randint(0, 10, (8 * a.steps,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8, drop_last=True)
    model = torchvision.models.resnet50(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    cfg = labkit.TrainConfig(epochs=1, max_steps=a.steps, log_every=0, eval_every=0)

    with LocalGCSServer() as server:
        gcs.client().create_bucket("bench-ckpt")
        if os.environ.get("BENCH_NICE_SERVER", "1") == "1":  # stands in for a remote server's CPUs
            os.setpriority(os.PRIO_PROCESS, server.proc.pid, 10)
        if a.pin:
            os.sched_setaffinity(server.proc.pid, writer_cpus)
        ckpt = CheckpointManager("gs://bench-ckpt/run", keep=2, rt=rt, best_metric=None)
        writer_cpu_s = []
        write = ckpt._write  # what the background writer's thread runs: pin it and count its CPU time

        def pinned_write(*args, **kwargs):
            os.sched_setaffinity(0, writer_cpus)
            t = time.thread_time()
            try:
                return write(*args, **kwargs)
            finally:
                writer_cpu_s.append(time.thread_time() - t)

        ckpt._write = pinned_write

        class Probe:
            def __init__(self):
                self.t = time.perf_counter()
                self.rows = []  # (step, seconds, overlapped an upload, blocked in save())
                self.compiles = None
                self.save_cpu_s = 0.0  # CPU time of the main thread inside save()

            def on_step_end(self, trainer, batch):
                busy = ckpt.pending is not None
                blocked = 0.0
                if trainer.step in a.save_at:
                    if self.compiles is None:
                        self.compiles = met.metric_data("CompileTime")[0]
                    t0, c0 = time.perf_counter(), time.thread_time()
                    ckpt.save(trainer.step, trainer.state_dict())
                    blocked = time.perf_counter() - t0
                    self.save_cpu_s += time.thread_time() - c0
                now = time.perf_counter()
                self.rows.append((trainer.step, now - self.t, busy, blocked))
                self.t = now

        probe = Probe()
        trainer = labkit.Trainer(model, opt, rt, cfg, loader, callbacks=[probe], checkpoint=ckpt)
        trainer.fit()
        extra_compiles = met.metric_data("CompileTime")[0] - probe.compiles
        rows = [r for r in probe.rows if r[0] > 3]  # past the two compiles
        over = [r[1] for r in rows if r[2] and not r[3]]
        plain = [r[1] for r in rows if not r[2] and not r[3]]
        blocked = [r[3] for r in rows if r[3]]
        print(f"steps measured: {len(rows)} ({len(over)} overlapping an upload, {len(plain)} without)")
        print(f"step time without upload  {statistics.mean(plain):.3f} s (median {statistics.median(plain):.3f})")
        if over:
            print(f"step time during upload   {statistics.mean(over):.3f} s (median {statistics.median(over):.3f})")
            print(f"ratio overlap/plain       {statistics.mean(over) / statistics.mean(plain):.3f}  (goal <= 1.05)")
        print(f"save() blocks the step    {statistics.mean(blocked):.3f} s (one batched device->host copy)")
        print(f"compiles caused by saving {extra_compiles}")
        ckpt.wait()
        saved_gb = len(writer_cpu_s) * ckpt.latest()["size"] / 1e9
        host_cpu = sum(writer_cpu_s) + probe.save_cpu_s
        print(
            f"host CPU per GB saved     {host_cpu / saved_gb:.1f} CPU-s/GB ({len(writer_cpu_s)} saves, "
            f"{saved_gb:.2f} GB: writer thread {sum(writer_cpu_s):.2f} s + save() in the step {probe.save_cpu_s:.2f} s)"
        )

        # throughput: the whole verified save vs a plain upload of the same bytes
        state = trainer.state_dict()
        sync = CheckpointManager("gs://bench-ckpt/tput", keep=1, rt=rt, async_save=False, best_metric=None)
        t0 = time.perf_counter()
        sync.save(1, state)
        t_ckpt = time.perf_counter() - t0
        size = sync.latest()["size"]
        with tempfile.NamedTemporaryFile(suffix=".pt") as f:
            f.write(gcs.blob("gs://bench-ckpt/tput/ckpt-00000001.pt").download_as_bytes())
            f.flush()
            t0 = time.perf_counter()
            gcs.blob("gs://bench-ckpt/plain/x.pt").upload_from_filename(f.name)
            t_plain = time.perf_counter() - t0
        mb = size / 1e6
        print(
            f"checkpoint {mb:.1f} MB: save {mb / t_ckpt:.0f} MB/s ({t_ckpt:.2f} s), plain upload "
            f"{mb / t_plain:.0f} MB/s ({t_plain:.2f} s), ratio {t_ckpt / t_plain:.2f}x the plain time"
        )


if __name__ == "__main__":
    main()
