"""Run in a subprocess (CPU_NUM_DEVICES and SPMD are fixed per process) for tests/test_sharded_checkpoint.py.

    python tests/children/sharded_ckpt_run.py save 8 ROOT REF      # FSDP GPT over 8 devices: train, save steps 1 and 2
    python tests/children/sharded_ckpt_run.py restore 4 ROOT REF   # FSDP over 4 devices (1: one device, no SPMD)

The saves go through CheckpointManager (format "auto": the state is sharded, so DCP shards); the
4-device restore reads them through CheckpointManager too, the 1-device one through ShardedCheckpointManager.

`save` writes REF (torch.save of {step: full CPU copy of the state}) after each committed save, so a
test that kills it during the save of step 2 still has step 1's reference. `restore` prints one
CHECK line per claim and exits 1 if any failed."""

import os
import sys

MODE, N, ROOT, REF = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = str(N)

import torch  # noqa: E402
from ckpt_hooks import install_from_env  # noqa: E402
from torch.utils._pytree import tree_leaves, tree_map  # noqa: E402

import labkit  # noqa: E402
from labkit.checkpoint import CheckpointManager  # noqa: E402
from labkit.checkpoint.sharded import ShardedCheckpointManager, folder_name, is_sharded  # noqa: E402
from labkit.lessons import parallel_gpt as PG  # noqa: E402
from labkit.models.gpt import GPT, GPTConfig  # noqa: E402
from labkit.spmd import sharding as S  # noqa: E402

CFG = GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=32, vocab_size=64)
rt = labkit.setup("xla-cpu", spmd=N > 1)
import torch_xla  # noqa: E402

device = torch_xla.device()
ok = True


def check(name, cond, detail=""):
    global ok
    ok &= bool(cond)
    print("CHECK", name, "OK" if cond else "FAIL", detail, flush=True)


def build(seed):
    if N > 1:
        model, opt, _, _ = PG.build(PG.Strategy("fsdp"), CFG, device, lr=1e-2, seed=seed)
        return model, getattr(model, "module", model), opt
    torch.manual_seed(seed)
    model = GPT(CFG).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    PG._init_adamw_state(opt)
    return model, model, opt


def state_of(inner, opt):
    # the inner module's keys: the same with or without the FSDP wrapper, so any layout can restore it
    return {"model": inner.state_dict(), "optim": opt.state_dict(), "note": "fsdp-8"}


model, inner, opt = build(seed=0 if MODE == "save" else 1)
if MODE == "save":
    ckpt = CheckpointManager(ROOT, keep=3)
    install_from_env(ckpt)  # the kill test holds the save of step 2 open (tests/children/ckpt_hooks.py)
    g = torch.Generator().manual_seed(0)
    refs = {}
    for step in (1, 2):
        x = torch.randint(0, CFG.vocab_size, (N, CFG.block_size + 1), generator=g).to(device)
        _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch_xla.sync()
        state = state_of(inner, opt)
        assert is_sharded(state), "the FSDP state should be sharded"
        ckpt.save(step, state, {"loss": float(loss)})
        ckpt.wait()
        assert os.path.isdir(os.path.join(ROOT, folder_name(step))), "a sharded state should be saved as DCP shards"
        refs[step] = tree_map(lambda t: t.cpu() if torch.is_tensor(t) else t, state)
        torch.save(refs, REF)
        print("SAVED", step, flush=True)
    ckpt.close()
    sys.exit(0)

refs = torch.load(REF, weights_only=True)
state = state_of(inner, opt)
want_sharded = N > 1
check("target layout", is_sharded(state) == want_sharded, S.sharding_of(next(iter(inner.parameters()))))
if N > 1:
    assert CheckpointManager(ROOT).restore(into=state) is state
    step = CheckpointManager(ROOT).latest()["step"]
else:
    ck = ShardedCheckpointManager(ROOT)
    assert ck.restore(into=state) is state
    step = ck.restored["step"]
expect = int(os.environ.get("EXPECT_STEP", max(refs)))
check("restored step", step == expect, (step, expect))
got, want = tree_leaves(state), tree_leaves(refs[step])
check("same leaves", len(got) == len(want), (len(got), len(want)))
diff = [i for i, (a, b) in enumerate(zip(got, want)) if torch.is_tensor(b) and not torch.equal(a.cpu(), b)]
check("bit-identical", not diff, diff[:5])
check("still sharded as built", is_sharded(state) == want_sharded)
# the restored state trains: one step on the target layout runs and gives a finite loss
x = torch.randint(0, CFG.vocab_size, (N, CFG.block_size + 1), generator=torch.Generator().manual_seed(5)).to(device)
_, loss = model(x[:, :-1], x[:, 1:])
loss.backward()
opt.step()
torch_xla.sync()
check("trains after restore", torch.isfinite(loss.cpu()).item(), float(loss))
sys.exit(0 if ok else 1)
