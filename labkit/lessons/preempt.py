"""Notebook 01's preemption drill: a run in a child process gets SIGTERM while a checkpoint is uploading, and
the notebook resumes it at the same sample.

    from labkit.lessons import preempt
    child = preempt.start(root)                  # python -m labkit.lessons.preempt ROOT: trains, saves every 4 steps
    step = preempt.wait_for_upload(child, root)  # an upload began (slowed to UPLOAD_S): its step
    child.send_signal(signal.SIGTERM)            # what a preempted TPU VM or a stopped runtime gets
    out = preempt.finish(child)                  # its output, with labkit's "finishing the pending checkpoint upload"
    trainer = preempt.trainer(root, rt, resume=True); trainer.fit()   # continues from the checkpoint

The run is a small MLP on numbered samples (feature 0 holds each sample's index), read in order, so every
step's samples say where the run is: the child writes them to ROOT/samples.jsonl, the resumed Trainer records
them in `trainer.samples`. The child trains on the plain CPU (a second process cannot share the notebook's TPU);
the checkpoint it leaves is device-free and resumes on any backend. Its uploads are slowed on purpose (a sleep
before each checkpoint object is stored, standing in for a large file going to a bucket) so that the SIGTERM
surely lands during one: the Trainer (labkit.interrupts) then waits for that upload before the process ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

N, BATCH, EVERY = 512, 8, 4  # samples, batch, steps between checkpoints
UPLOAD_S = 2.0  # each checkpoint object's upload is held this long
MARK = "uploading"  # a file under root naming the checkpoint object whose upload began


def data():
    """N numbered samples: feature 0 is the sample's index, the label a fixed function of the rest."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 16, generator=g)
    x[:, 0] = torch.arange(N, dtype=torch.float32)
    return torch.utils.data.TensorDataset(x, (x[:, 1:5]).argmax(1))


class _Recorder:
    """A callback: the indices of each step's samples (a host read per step: fine for a drill, not for a run)."""

    def __init__(self, path=None):
        self.samples, self.path = [], path

    def on_step_end(self, trainer, batch):
        ids = batch[0][:, 0].long().cpu().tolist()
        self.samples.append(ids)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.step, "samples": ids}) + "\n")


def trainer(root, rt, *, resume=False, max_steps=48, record_to=None):
    """The drill's Trainer: the same model, data order and checkpoints in the child and in the notebook."""
    import labkit
    from labkit.checkpoint import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH)  # in order: the same samples every run
    cfg = labkit.TrainConfig(
        epochs=1, max_steps=max_steps, log_every=EVERY, eval_every=0, checkpoint_every=EVERY, resume=resume
    )
    rec = _Recorder(record_to)
    tr = labkit.Trainer(model, opt, rt, cfg, loader, callbacks=[rec], checkpoint=CheckpointManager(root, keep=2, rt=rt))
    tr.samples = rec.samples
    return tr


def _slow_uploads(manager, root):
    """Hold each checkpoint object's upload for UPLOAD_S, after writing ROOT/uploading (its name)."""
    store = manager.store
    for method in ("put", "put_if_absent"):
        real = getattr(store, method)

        def slow(name, *args, _real=real, **kwargs):
            if name.startswith("ckpt-"):
                with open(os.path.join(root, MARK), "w") as f:
                    f.write(name)
                time.sleep(UPLOAD_S)
            return _real(name, *args, **kwargs)

        setattr(store, method, slow)


def start(root) -> subprocess.Popen:
    """The child: python -m labkit.lessons.preempt ROOT, its output piped."""
    os.makedirs(root, exist_ok=True)
    env = {**os.environ, "LABKIT_FAST": "0"}  # the drill's own sizes, whatever the notebook runs with
    return subprocess.Popen(
        [sys.executable, "-m", "labkit.lessons.preempt", root],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_upload(child, root, timeout_s=300) -> int:
    """The step of the first checkpoint whose upload began (ROOT/uploading appeared)."""
    mark, t0 = os.path.join(root, MARK), time.monotonic()
    while not os.path.exists(mark):
        if child.poll() is not None:
            raise RuntimeError(f"the child ended (exit {child.returncode}) before any upload:\n{child.stdout.read()}")
        if time.monotonic() - t0 > timeout_s:
            child.kill()
            raise TimeoutError(f"no upload began in {timeout_s} s")
        time.sleep(0.05)
    with open(mark) as f:
        return int(f.read().split("-")[1].split(".")[0])


def finish(child, timeout_s=120) -> str:
    """Wait for the child; its output (stdout and stderr)."""
    out, _ = child.communicate(timeout=timeout_s)
    return out


def steps_recorded(root) -> list[dict]:
    with open(os.path.join(root, "samples.jsonl")) as f:
        return [json.loads(line) for line in f]


def main(argv=None) -> int:
    import labkit
    from labkit.interrupts import Preempted

    root = (argv or sys.argv[1:])[0]
    rt = labkit.setup("cpu")
    tr = trainer(root, rt, max_steps=N // BATCH, record_to=os.path.join(root, "samples.jsonl"))
    _slow_uploads(tr.checkpoint, root)
    try:
        tr.fit()
    except Preempted as e:
        print(f"child: {e}; stopped at step {tr.step}", flush=True)
        return 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended
    print(f"child: finished all {tr.step} steps (no SIGTERM came)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
