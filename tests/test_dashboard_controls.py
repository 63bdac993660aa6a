"""The dashboard's buttons: they exist, a click (ipywidgets' Button.click() fires on_click) asks the Trainer,
and a real small run on XLA:CPU and CPU then stops after the epoch and saves the checkpoint asked for."""

import io
import os
import re
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


def test_a_fit_in_the_main_thread_is_told_that_clicks_wait():
    """`trainer.fit()` in a cell runs in the kernel's main thread, where no click arrives before the cell ends:
    the label says so as the fit begins. A fit in a thread (fit_with_buttons) gets a clean label."""
    import threading

    c = Controls()
    c.widget()
    c.bind(FakeTrainer())
    assert "a click waits for this cell to end" in c.status.value
    assert "await labkit.dashboard.fit_with_buttons(trainer)" in c.status.value
    t = threading.Thread(target=c.bind, args=(FakeTrainer(),))
    t.start()
    t.join()
    assert c.status.value == ""


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


def kernel_setup(on_step_end: str, then: str) -> str:
    """The cell a kernel test runs first: a 500-epoch MLP fit on the CPU with the notebook dashboard, its
    buttons shown now (fit() shows the same ones: a test needs their ids); `on_step_end` is the body of a
    callback after each step (a few ms, so the run is still going when the test acts), `then` runs last."""
    return f"""
import os, time, asyncio, ipykernel, ipywidgets
os.environ.pop('LABKIT_CONSOLE', None)
import torch, labkit
from labkit.dashboard import NotebookSink
from labkit.dashboard.controls import fit_with_buttons
from tests.helpers import blobs, mlp

class Pace:
    def on_step_end(self, trainer, batch):
        {on_step_end}

rt = labkit.setup('cpu')
model = mlp()
dash = labkit.Dashboard(title='steer', sink=NotebookSink())
tr = labkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), rt, labkit.TrainConfig(epochs=500, log_every=8),
    torch.utils.data.DataLoader(blobs(), batch_size=32), callbacks=[dash, Pace()])
dash.sink.begin(tr, dash)
{then}
"""


SLEEP = "time.sleep(0.01)"
STOP_ID = "print(dash.sink.controls.buttons['stop'].model_id)"


@pytest.mark.heavy
@pytest.mark.timeout(240)
def test_a_click_stops_a_fit_running_in_a_real_kernel(tmp_path):
    """ipykernel 7: while a cell awaits `asyncio.to_thread(trainer.fit)`, the kernel handles the click at once
    (the front end's comm message, as a browser sends it) and the run stops at the end of that epoch."""
    import ipykernel

    from tests.kernels import start_kernel

    if int(ipykernel.__version__.split(".")[0]) < 7:
        pytest.skip("ipykernel < 7 queues widget messages behind the running cell")
    km, kc = start_kernel(sys.executable, tmp_path)
    try:

        def run(code, wait=True, timeout=180):
            mid = kc.execute(code)
            if not wait:
                return mid
            return _collect(kc, mid, timeout)

        out, err = run(kernel_setup(SLEEP, STOP_ID))
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
        kc.stop_channels()
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


def _run_after_error(kc, code, tries=5):
    """stdout and error text of `code` sent after a cell that ended in an error. A kernel aborts the requests
    that reach it in a short window after an error (stop_on_error: Run all stops at the failing cell); an
    aborted request runs nothing (its reply says "aborted", no output), so it is sent again, up to `tries`."""
    for _ in range(tries):
        mid = kc.execute(code)
        out, err = _collect(kc, mid, 60)
        while (reply := kc.get_shell_msg(timeout=60))["parent_header"].get("msg_id") != mid:
            pass  # replies to earlier requests
        if reply["content"]["status"] != "aborted":
            return out, err
        time.sleep(0.5)
    raise AssertionError(f"the kernel aborted {code!r} {tries} times in a row")


IPYKERNEL6_SETUP = kernel_setup(
    "print(f'talk {trainer.step}', flush=True); time.sleep(0.01)",  # output sent while widget messages are handled
    "slow = ipywidgets.Button(description='slow')  # a handler that takes its time, like a real one might\n"
    "slow.on_click(lambda _b: time.sleep(0.8))\n"
    "print(ipykernel.__version__, ipywidgets.__version__, slow.model_id, dash.sink.controls.buttons['stop'].model_id)",
)


@pytest.mark.heavy  # builds .venvs/colab-kernel (the 3.13 run leaves it to the 3.11 run, which shares it)
@pytest.mark.timeout(300)
def test_clicks_in_ipykernel_6_leave_the_cells_output_in_the_cell(tmp_path):
    """Colab's ipykernel 6.17.1: `await fit_with_buttons(tr)` handles widget messages mid-run (a slow
    handler, the front end's comm_info_request, the Stop click), and everything the fit thread prints
    meanwhile still belongs to the cell: a front end shows only output whose parent is the cell's request."""
    from tests.kernels import colab_kernel, start_kernel

    km, kc = start_kernel(colab_kernel(), tmp_path)
    try:
        out, err = _collect(kc, kc.execute(IPYKERNEL6_SETUP), 180)
        assert not err, err
        kernel_v, widgets_v, slow_id, stop_id = out.strip().splitlines()[-1].split()
        assert kernel_v == "6.17.1" and widgets_v == "7.7.1", out
        cell = kc.execute("h = await fit_with_buttons(tr)")
        time.sleep(4)  # the fit is running (500 epochs would take minutes)
        sent = {}
        for what, msg_type, content in [
            ("slow", "comm_msg", {"comm_id": slow_id, "data": {"method": "custom", "content": {"event": "click"}}}),
            ("info", "comm_info_request", {"target_name": "jupyter.widget"}),
            ("stop", "comm_msg", {"comm_id": stop_id, "data": {"method": "custom", "content": {"event": "click"}}}),
        ]:
            msg = kc.session.msg(msg_type, content)
            kc.shell_channel.send(msg)
            sent[msg["header"]["msg_id"]] = what
            time.sleep(0.3)
        talk_in_cell, talk_elsewhere, idle_for = [], [], set()
        deadline = time.time() + 180
        while time.time() < deadline:
            m = kc.get_iopub_msg(timeout=180)
            parent = m["parent_header"].get("msg_id")
            if m["msg_type"] == "stream" and "talk " in m["content"]["text"]:
                (talk_in_cell if parent == cell else talk_elsewhere).append(m["content"]["text"])
            elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                if parent == cell:
                    break
                idle_for.add(sent.get(parent))
        else:
            raise TimeoutError("the fit did not stop in 180 s")
        replies = []
        while kc.shell_channel.msg_ready():
            replies.append(kc.get_shell_msg(timeout=1))
        info = [r for r in replies if r["msg_type"] == "comm_info_reply"]
        assert not talk_elsewhere, f"the fit thread's output went to a widget message: {talk_elsewhere[:3]}"
        assert len(talk_in_cell) >= 2, talk_in_cell
        # each widget message was answered while the cell ran: busy/idle for it (a front end's request
        # resolves on those), and the comm_info_request's reply
        assert idle_for >= {"slow", "info", "stop"}, idle_for
        assert info and info[0]["parent_header"]["msg_id"] in sent and info[0]["content"]["status"] == "ok", replies
        out, err = _collect(kc, kc.execute("print(tr.step, tr.epoch, repr(dash.sink.controls.status.value))"), 60)
        assert not err, err
        step, epoch, status = out.split(maxsplit=2)
        assert 0 < int(epoch) < 500 and int(step) == 8 * int(epoch), out
        assert status.startswith("'stopping after epoch"), out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.heavy  # the ipykernel 6 case builds .venvs/colab-kernel
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stack", ["ipykernel7", "colab"])
def test_interrupting_the_kernel_stops_the_fit_in_its_thread(stack, tmp_path):
    """The kernel's interrupt (the notebook's stop button) cancels `await fit_with_buttons(tr)`; the fit in
    its thread stops after its step, before the cell ends, and stays stopped (before, it trained on)."""
    from tests.kernels import colab_kernel, start_kernel

    km, kc = start_kernel(colab_kernel() if stack == "colab" else sys.executable, tmp_path)
    try:
        out, err = _collect(kc, kc.execute(kernel_setup(SLEEP, "")), 180)
        assert not err, err
        cell = kc.execute("h = await fit_with_buttons(tr)")
        time.sleep(4)  # mid-run (500 epochs would take minutes)
        km.interrupt_kernel()
        out, err = _collect(kc, cell, 120)
        assert "CancelledError" in err, err[-2000:]
        said = re.search(r"interrupted at step (\d+).*the fit stopped at step (\d+)", out, re.S)
        assert said, out
        at, stopped = (int(v) for v in said.groups())
        assert 0 < at <= stopped <= at + 1, out
        steps = []
        for _ in range(2):
            o, e = _run_after_error(kc, "print(tr.step)")
            assert not e, e
            steps.append(o.split())
            time.sleep(1.0)
        assert steps[0] == steps[1] == [str(stopped)], (steps, out)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
