"""The dashboard's buttons: they exist, a click (ipywidgets' Button.click() fires on_click) asks the Trainer,
and a real small run on XLA:CPU and CPU then stops after the epoch and saves the checkpoint asked for."""

import io
import os
import sys
import time

import pytest
import torch

import labkit
from labkit import Dashboard, TrainConfig, Trainer
from labkit.checkpoint import CheckpointManager
from labkit.dashboard import ConsoleSink, NotebookSink
from labkit.dashboard.controls import PROFILE_SIGNAL, Controls, script_help
from tests.helpers import blobs, mlp

pytest.importorskip("ipywidgets")


class FakeTrainer:
    """Records what the buttons ask for."""

    def __init__(self, checkpoint="a manager"):
        self.calls, self.step, self.epoch, self.checkpoint = [], 7, 1, checkpoint

    def request_profile(self, steps=5, out_dir=None):
        self.calls.append(("profile", steps))

    def request_stop(self, after_epoch=False):
        self.calls.append(("stop", after_epoch))

    def request_checkpoint(self):
        self.calls.append(("save",))


def test_buttons_call_the_trainer():
    c = Controls()
    box = c.widget()
    assert box is not None and c.widget() is box  # built once
    assert {b.description for b in c.buttons.values()} == {
        "Profile next N steps",
        "Stop after this epoch",
        "Save a checkpoint now",
    }
    c.buttons["stop"].click()  # nothing bound yet: says so, raises nothing
    assert c.status.value.startswith("no fit() is running")
    tr = FakeTrainer()
    c.bind(tr)
    c.steps.value = 3
    c.buttons["profile"].click()
    c.buttons["stop"].click()
    c.buttons["save"].click()
    assert tr.calls == [("profile", 3), ("stop", True), ("save",)]
    assert c.status.value == "saving after step 7"
    c.bind(FakeTrainer(checkpoint=None))  # no CheckpointManager: no request, and the label says why
    c.buttons["save"].click()
    assert c.trainer.calls == [] and "no CheckpointManager" in c.status.value
    c.unbind()  # the fit ended: a click now would be lost at the next fit(), so it is refused and said
    c.buttons["stop"].click()
    assert c.trainer.calls == [] and "await fit_with_buttons(trainer)" in c.status.value


def test_without_ipywidgets_there_are_no_buttons(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import fails
    c = Controls()
    assert c.widget() is None
    c.bind(FakeTrainer())
    c._act("stop")  # no label to write to: still no error
    sink = NotebookSink()
    sink.begin(FakeTrainer(), Dashboard(sink=sink))  # nothing displayed, nothing raised
    assert sink.controls.box is None


class Headless(NotebookSink):
    """The notebook sink (its buttons included) minus the IPython display of the figure (no front end)."""

    def draw(self, frame, dash):
        pass


class ClickAt:
    """A callback that clicks the dashboard's buttons after given steps, as a person would mid-run."""

    def __init__(self, dash, clicks):
        self.dash, self.clicks = dash, clicks

    def on_step_end(self, trainer, batch):
        for name in self.clicks.get(trainer.step, ()):
            self.dash.sink.controls.buttons[name].click()


@pytest.mark.parametrize("kind", ["xla-cpu", "cpu"])
def test_stop_after_epoch_and_save_now_in_a_real_run(kind, tmp_path):
    rt = labkit.setup(kind)
    model = mlp()
    ckpt = CheckpointManager(tmp_path / "ckpt", keep=10, async_save=False, best_metric=None)
    dash = Dashboard(sink=Headless(), find_syncs=False)
    clicks = ClickAt(dash, {3: ["save"], 5: ["stop"]})  # 8 steps per epoch; both clicks in epoch 0
    tr = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        rt,
        TrainConfig(epochs=3, log_every=4),
        torch.utils.data.DataLoader(blobs(), batch_size=32),
        checkpoint=ckpt,
        callbacks=[dash, clicks],
    )
    tr.fit()
    # the epoch was finished (not cut at step 5), then the run stopped: epoch 1 never started
    assert tr.step == 8 and tr.epoch == 1 and tr.batch_in_epoch == 0
    assert [h["step"] for h in tr.history] == [4, 8]
    # the click's checkpoint (step 3) and the epoch-end one (step 8)
    assert sorted(f for f in os.listdir(tmp_path / "ckpt") if f.endswith(".pt")) == [
        "ckpt-00000003.pt",
        "ckpt-00000008.pt",
    ]
    assert "stopping after epoch 0" == dash.sink.controls.status.value
    # a new fit() starts with no stop pending: it trains the remaining epochs
    tr.fit()
    assert tr.step == 24 and tr.epoch == 3


def test_profile_button_with_a_real_trainer(tmp_path, monkeypatch):
    if not hasattr(Trainer, "request_profile"):
        pytest.skip("Trainer.request_profile is not in this tree")
    rt = labkit.setup("cpu")
    model = mlp()
    dash = Dashboard(sink=Headless(), find_syncs=False)
    tr = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        rt,
        TrainConfig(epochs=1, log_every=4),
        torch.utils.data.DataLoader(blobs(), batch_size=32),
        callbacks=[dash, ClickAt(dash, {2: ["profile"]})],
    )
    monkeypatch.setenv("LABKIT_PROFILE_DIR", str(tmp_path / "profiles"))
    dash.sink.begin(tr, dash)
    dash.sink.controls.steps.value = 2
    tr.fit()
    assert len(tr.profiles) == 1 and len(tr.profiles[0].steps) == 2


def test_console_twin_says_how_once():
    out = io.StringIO()
    rt = labkit.setup("cpu")
    model = mlp()
    dash = Dashboard(sink=ConsoleSink(out), find_syncs=False, title="t")
    tr = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        rt,
        TrainConfig(epochs=1, log_every=4, max_steps=4),
        torch.utils.data.DataLoader(blobs(), batch_size=32),
        callbacks=[dash],
    )
    tr.fit()
    tr.fit()  # a second fit: not printed again
    text = out.getvalue()
    assert text.count("trainer.request_profile(N)") == 1
    assert "trainer.request_stop(after_epoch=True)" in text and "trainer.request_checkpoint()" in text
    assert f"kill -USR1 {os.getpid()}" in text and PROFILE_SIGNAL == "SIGUSR1"
    assert script_help(123)[0].count("123") == 1
    quiet = io.StringIO()
    Dashboard(sink=ConsoleSink(quiet), controls=False).sink.begin(tr, Dashboard(controls=False))
    assert quiet.getvalue() == ""


KERNEL_SETUP = """
import os, time, asyncio
os.environ.pop('LABKIT_CONSOLE', None)
import torch, labkit
from labkit.dashboard import NotebookSink
from labkit.checkpoint import CheckpointManager
from tests.helpers import blobs, mlp

class Slow:  # a few ms per step, so that the run is still going when the click comes
    def on_step_end(self, trainer, batch):
        time.sleep(0.01)

rt = labkit.setup('cpu')
model = mlp()
dash = labkit.Dashboard(title='steer', sink=NotebookSink())
tr = labkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), rt, labkit.TrainConfig(epochs=500, log_every=8),
    torch.utils.data.DataLoader(blobs(), batch_size=32), callbacks=[dash, Slow()])
dash.sink.begin(tr, dash)  # the buttons now (fit() shows the same ones): the test needs their ids
print(dash.sink.controls.buttons['stop'].model_id)
"""


@pytest.mark.heavy
@pytest.mark.timeout(240)
def test_a_click_stops_a_fit_running_in_a_real_kernel():
    """ipykernel 7: while a cell awaits `asyncio.to_thread(trainer.fit)`, the kernel handles the click at once
    (the front end's comm message, as a browser sends it) and the run stops at the end of that epoch."""
    import ipykernel
    from jupyter_client.manager import start_new_kernel

    if int(ipykernel.__version__.split(".")[0]) < 7:
        pytest.skip("ipykernel < 7 queues widget messages behind the running cell")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    km, kc = start_new_kernel(kernel_name="python3", cwd=root, env=env)
    try:

        def run(code, wait=True, timeout=180):
            mid = kc.execute(code)
            if not wait:
                return mid
            return _collect(kc, mid, timeout)

        out, err = run(KERNEL_SETUP)
        assert not err, err
        stop_id = out.strip().splitlines()[-1]
        mid = run("h = await asyncio.to_thread(tr.fit)", wait=False)
        time.sleep(4)  # the fit is running (500 epochs would take minutes): now a person clicks
        click = {"comm_id": stop_id, "data": {"method": "custom", "content": {"event": "click"}}}
        kc.shell_channel.send(kc.session.msg("comm_msg", click))
        _, err = _collect(kc, mid, 180)
        assert not err, err
        out, err = run("print(tr.step, tr.epoch, tr.batch_in_epoch, repr(dash.sink.controls.status.value))")
        assert not err, err
        step, epoch, in_epoch, status = out.split(maxsplit=3)
        assert 0 < int(epoch) < 500 and int(step) == 8 * int(epoch) and int(in_epoch) == 0, out
        assert status.startswith("'stopping after epoch"), out
    finally:
        km.shutdown_kernel(now=True)


def _collect(kc, mid, timeout):
    """stdout and error text of one execution, once the kernel is idle again."""
    out, err = [], []
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = kc.get_iopub_msg(timeout=timeout)
        if m["parent_header"].get("msg_id") != mid:
            continue
        if m["msg_type"] == "stream":
            out.append(m["content"]["text"])
        elif m["msg_type"] == "error":
            err.append("\n".join(m["content"]["traceback"]))
        elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
            return "".join(out), "".join(err)
    raise TimeoutError(f"execution {mid} did not finish in {timeout} s")
