"""Train a tiny MLP with checkpoints; run as a subprocess by tests/test_resume.py.

    python tests/children/ckpt_train_script.py ROOT OUT.pt --steps 12 --every 3 [--resume] [--kill-at N] [--sharded]

--kill-at N: SIGKILL this process right after optimizer step N (no cleanup, like a lost VM).
CKPT_TEST_KILL=STEP / CKPT_TEST_HOLD=STEP:SECONDS: kill the process inside the save of STEP, or hold
that save open (tests/children/ckpt_hooks.py installs the hook on the manager).
The epoch order depends only on (seed, epoch), so a resumed run sees the same batches; the
DataLoader gets its own generator because creating an iterator otherwise draws from torch's
global RNG, which would shift the dropout draws of a run resumed mid-epoch.
"""

import argparse
import os
import signal

import torch
from ckpt_hooks import install_from_env
from torch.utils.data import DataLoader, Sampler, TensorDataset

import labkit
from labkit.checkpoint import CheckpointManager


class EpochSampler(Sampler):
    def __init__(self, n, seed):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self):
        return self.n


class Loader(DataLoader):
    def set_epoch(self, epoch):
        self.sampler.set_epoch(epoch)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--sharded", action="store_true", help="CheckpointManager(format='sharded'): DCP shards")
    a = ap.parse_args()
    rt = labkit.setup(a.backend)
    rt.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g)
    loader = Loader(
        TensorDataset(x, y),
        batch_size=8,
        sampler=EpochSampler(40, seed=7),
        drop_last=True,
        generator=torch.Generator().manual_seed(3),
    )  # iterator seeds: not from the global RNG
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    cfg = labkit.TrainConfig(
        epochs=100, max_steps=a.steps, checkpoint_every=a.every, resume=a.resume, log_every=0, eval_every=0
    )
    # --sharded: the DCP format that CheckpointManager picks by itself for a state split over devices
    fmt = "sharded" if a.sharded else "auto"
    ckpt = CheckpointManager(a.root, keep=2, rt=rt, retry_deadline_s=5, format=fmt)
    install_from_env(ckpt)
    cbs = []
    if a.kill_at:

        class Killer:
            def on_step_end(self, trainer, batch):
                if trainer.step == a.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)

        cbs.append(Killer())
    tr = labkit.Trainer(model, opt, rt, cfg, loader, scheduler=sched, checkpoint=ckpt, callbacks=cbs)
    tr.fit()
    torch.save({k: v.cpu() for k, v in tr.module.state_dict().items()}, a.out)
    print("done", tr.step)


if __name__ == "__main__":
    main()
