"""Run by tests/test_meta_init.py: a meta-built model sharded by fully_shard over a fake process group of 3 ranks
(this process is the last one, whose shares are the uneven ones), then materialized. Prints two JSON lines:

- "moved": the sizes of the tensors materialize passed to Tensor.to (a whole tensor moved to the device shows
  here; a shard cut on the CPU and copied into the local shard does not);
- "equal": per parameter, whether the local shard equals the CPU build's part of the whole (torch.chunk over 3);
- "init_fn": per parameter written by init_fn, whether its shard equals the CPU build followed by init_fn, and
  whether init_fn's constant reached the shard.

    python tests/children/meta_shards.py
"""

import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from labkit import meta_init

RANK, WORLD = 2, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.lin = nn.Linear(4, 7)
        self.register_buffer("scale", torch.empty(5))
        self.scale.fill_(2.0)


def init_fn(m):
    nn.init.normal_(m.lin.weight)
    nn.init.constant_(m.lin.bias, 3.0)


def shard(model):
    fully_shard(model)
    return model


def main():
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    torch.manual_seed(0)
    ref = Net()
    moved, to = [], torch.Tensor.to

    def spy(self, *args, **kwargs):
        moved.append(self.numel())
        return to(self, *args, **kwargs)

    model = shard(meta_init.build(Net, seed=0))
    torch.Tensor.to = spy
    try:
        meta_init.materialize(model, "cpu")
    finally:
        torch.Tensor.to = to
    equal = {}
    for name, t in model.named_parameters():
        part = dict(ref.named_parameters())[name].detach().chunk(WORLD)[RANK]
        local = t.to_local()
        equal[name] = local.shape == part.shape and torch.equal(local, part)
    equal["scale"] = torch.equal(model.scale, ref.scale)
    print(json.dumps({"moved": moved, "equal": equal}), flush=True)
    torch.manual_seed(0)  # the CPU build followed by init_fn
    ref = Net()
    with torch.no_grad():
        init_fn(ref)
    model = shard(meta_init.build(Net, seed=0, init_fn=init_fn))
    meta_init.materialize(model, "cpu")
    after = {}
    for name in ("lin.weight", "lin.bias"):
        local = dict(model.named_parameters())[name].to_local()
        part = dict(ref.named_parameters())[name].detach().chunk(WORLD)[RANK]
        after[name] = local.shape == part.shape and torch.equal(local, part)
    bias = dict(model.named_parameters())["lin.bias"].to_local()
    print(json.dumps({"init_fn": after, "bias_3": bool((bias == 3.0).all())}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
