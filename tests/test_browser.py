"""The live dashboard as a person sees it: JupyterLab on 127.0.0.1, headless Chromium driven by Selenium.

A small notebook (an MLP on generated data on XLA:CPU, epochs of ~1.5 s) runs with "Run All" on two kernel
stacks: the project's (ipykernel 7, ipywidgets 8: the .venv) and Colab's pins (ipykernel 6.17.1, ipywidgets
7.7.1: a small venv .venvs/colab-kernel built with uv from images/colab-tpu.txt, the rest of its packages
read from the project venv). While the cell runs the test samples the page and asserts that the step counter
and the figure change several times and that the XLA numbers are shown; it clicks "Stop after this epoch"
and asserts that the run stops at the end of that epoch. Screenshots go to $LABKIT_ARTIFACTS/browser
(default artifacts/browser). The same browser then opens a book built from an executed notebook and checks
that every page loads, every figure loads and every internal link resolves.

Chromium comes from Debian (`chromium`, `chromium-driver`): scripts/bootstrap.sh (`make venv`) installs them
when it runs as root with apt-get; without them these tests skip and say how to get them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.kernels import COLAB_KERNEL, colab_kernel

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
HOW = (
    "run `make venv` as root (scripts/bootstrap.sh installs Debian's chromium and chromium-driver with apt-get), "
    "or `sudo apt-get install chromium chromium-driver`, then `make test`"
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

for _mod in ("selenium", "jupyterlab"):
    pytest.importorskip(_mod, reason=f"{_mod} is not installed: {HOW}")
if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip(f"no {CHROMIUM} / {CHROMEDRIVER}: {HOW}", allow_module_level=True)


def artifacts() -> Path:
    out = Path(os.environ.get("LABKIT_ARTIFACTS") or ROOT / "artifacts") / "browser"
    out.mkdir(parents=True, exist_ok=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the notebook -----------------------------------------------------------------------------------------

RUN_LINE = "history = await fit_with_buttons(trainer)  # a click acts mid-run, ipykernel 6 and 7"


def live_notebook(kernel: str, run_line: str = RUN_LINE) -> dict:
    import nbformat

    cells = [
        nbformat.v4.new_markdown_cell("# The dashboard, live\nA small MLP on generated data, on XLA:CPU."),
        nbformat.v4.new_code_cell(
            "import os, time, asyncio\n"
            "os.environ.pop('LABKIT_CONSOLE', None)  # the notebook view, not the console twin\n"
            "import torch, ipykernel, ipywidgets\n"
            "import labkit\n"
            "from labkit.dashboard.controls import fit_with_buttons\n"
            "print('kernel stack: ipykernel', ipykernel.__version__, 'ipywidgets', ipywidgets.__version__)\n"
            "rt = labkit.setup('xla-cpu')"
        ),
        nbformat.v4.new_code_cell(
            "g = torch.Generator().manual_seed(0)\n"
            "x = torch.randn(1280, 16, generator=g)\n"
            "y = (x @ torch.randn(16, 4, generator=g)).argmax(1)\n"
            "data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)  # 40 steps\n"
            "torch.manual_seed(0)\n"
            "model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))\n"
            "\n"
            "# ~35 ms a step: epochs of ~1.5 s, long enough to watch and to click in. The click ends the run;\n"
            "# 30 epochs leave time for a front end slow to draw the button.\n"
            "class Pace:\n"
            "    def on_step_end(self, trainer, batch):\n"
            "        time.sleep(0.035)\n"
            "\n"
            "dash = labkit.Dashboard(title='live', every=0.5)\n"
            "trainer = labkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), rt,\n"
            "                         labkit.TrainConfig(epochs=30, log_every=4), data, callbacks=[dash, Pace()])"
        ),
        nbformat.v4.new_code_cell(run_line),
        nbformat.v4.new_code_cell(
            "print(f'FINAL step={trainer.step} epoch={trainer.epoch} per_epoch={trainer.steps_per_epoch()} '\n"
            "      f'total={trainer.total_steps()}')"
        ),
    ]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": kernel, "display_name": kernel, "language": "python"}
    return nb


# -- the kernels and the server ---------------------------------------------------------------------------


class JupyterLab:
    """`python -m jupyterlab` on 127.0.0.1 with a token, its config, data and kernel specs under `home`."""

    def __init__(self, home: Path, kernels: dict[str, Path], jupyter_path: Path | None = None):
        self.root, self.port, self.token = home / "root", free_port(), hashlib.sha1(os.urandom(8)).hexdigest()
        self.root.mkdir()
        data = home / "data"
        for name, python in kernels.items():
            spec = data / "kernels" / name
            spec.mkdir(parents=True)
            argv = [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
            (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": name, "language": "python"}))
        settings = home / "settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True)  # no "receive Jupyter news?" toast over the page
        (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
        env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER")}
        env.pop("LABKIT_CONSOLE", None)
        env.update(
            JUPYTER_CONFIG_DIR=str(home / "config"),
            JUPYTER_DATA_DIR=str(data),
            JUPYTER_RUNTIME_DIR=str(home / "runtime"),
            JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
            JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
            JUPYTER_PATH=str(jupyter_path or ""),  # first place JupyterLab looks for its extensions
            PYTHONPATH=str(ROOT),
            PJRT_DEVICE="CPU",
            MPLBACKEND="Agg",
            TF_CPP_MIN_LOG_LEVEL="2",
        )
        self.log = open(home / "jupyterlab.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", f"--IdentityProvider.token={self.token}",
             f"--ServerApp.root_dir={self.root}", "--LabApp.news_url=None"]
            + (["--allow-root"] if os.geteuid() == 0 else []),
            env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.url('api/status')}", timeout=2).read()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (home / "jupyterlab.log").read_text()
                    raise RuntimeError(f"JupyterLab did not start; its log:\n{log}") from None
                time.sleep(0.3)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}?token={self.token}"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1100"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield driver
    driver.quit()


def start_lab(home: Path, stack: str) -> JupyterLab:
    """One server per stack: the kernel and the widget manager that the stack's widgets need."""
    if stack == "ipykernel7":
        return JupyterLab(home, {"labkit-ipykernel7": Path(sys.executable)})
    py = colab_kernel()
    return JupyterLab(home, {"labkit-colab": py}, jupyter_path=COLAB_KERNEL / "share" / "jupyter")


# -- what a person sees -----------------------------------------------------------------------------------

SAMPLE_JS = """
const outs = [...document.querySelectorAll('.jp-OutputArea-output')].map(e => e.innerText).join('\\n');
const imgs = [...document.querySelectorAll('.jp-OutputArea-output img')].map(i => i.src.length + ':' + i.src.slice(-48));
const labels = [...document.querySelectorAll('.widget-label')].map(e => e.innerText);
const running = [...document.querySelectorAll('.jp-InputPrompt')].some(e => e.innerText.includes('[*]'));
return {text: outs, imgs: imgs, labels: labels, running: running};
"""
STEP = re.compile(r"\[live\] step (\d+)/(\d+) ep (\d+)")
XLA = re.compile(r"compiles (\d+) \(([\d.]+)s\) graphs (\d+)")
FINAL = re.compile(r"FINAL step=(\d+) epoch=(\d+) per_epoch=(\d+) total=(\d+)")


def choose_kernel(driver, kernel: str) -> None:
    """JupyterLab asks which kernel to start when it has several specs: answer with the notebook's own."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    for dialog in driver.find_elements(By.CSS_SELECTOR, ".jp-Dialog"):
        for sel in dialog.find_elements(By.TAG_NAME, "select"):
            Select(sel).select_by_visible_text(kernel)
        dialog.find_element(By.CSS_SELECTOR, "button.jp-mod-accept").click()


def run_all(driver, lab: JupyterLab, name: str, kernel: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(lab.url(f"lab/tree/{name}"))
    wait = WebDriverWait(driver, 120)
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Cell")))
    wait.until(ec.presence_of_element_located((By.XPATH, "//div[contains(@class,'lm-MenuBar-itemLabel')][.='Run']")))
    # the kernel's name in the status bar once it runs (or the dialog that asks for one)
    status = f"//*[contains(@class,'jp-StatusBar')]//*[starts-with(normalize-space(.), '{kernel} |')]"
    WebDriverWait(driver, 120).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, ".jp-Dialog select") or d.find_elements(By.XPATH, status)
    )
    time.sleep(1)  # a dialog comes a moment after the page settles
    choose_kernel(driver, kernel)
    driver.find_element(By.XPATH, "//div[contains(@class,'lm-MenuBar-itemLabel')][.='Run']").click()
    item = wait.until(
        ec.element_to_be_clickable((By.XPATH, "//li[contains(@class,'lm-Menu-item')][.//div[.='Run All Cells']]"))
    )
    item.click()


def watch_and_stop(driver, lab: JupyterLab, stack: str, run_line: str = RUN_LINE) -> dict:
    """Run All, sample the page until the FINAL line appears (clicking Stop once an epoch has passed)."""

    name = f"live-{stack}.ipynb"
    kernel = "labkit-ipykernel7" if stack.startswith("ipykernel7") else "labkit-colab"
    (lab.root / name).write_text(json.dumps(live_notebook(kernel, run_line)))
    shots, out = artifacts(), {"steps": [], "imgs": set(), "xla": [], "clicked_at": None, "t": {}}
    t0 = time.monotonic()
    run_all(driver, lab, name, kernel)
    deadline = t0 + 240
    while time.monotonic() < deadline:
        s = driver.execute_script(SAMPLE_JS)
        if m := FINAL.search(s["text"]):
            out["final"] = tuple(int(v) for v in m.groups())
            out["labels"], out["text"] = s["labels"], s["text"]
            break
        steps = STEP.findall(s["text"])
        if not steps or not s["running"]:  # only what is seen while a cell runs ([*])
            time.sleep(0.2)
            continue
        step, total, epoch = (int(v) for v in steps[-1])
        out["t"].setdefault("first_step", time.monotonic() - t0)
        if not out["steps"] or out["steps"][-1] != step:
            out["steps"].append(step)
        out["imgs"].update(s["imgs"])
        out["xla"] += [tuple(float(v) for v in x) for x in XLA.findall(s["text"])]
        if len(out["steps"]) == 3:
            driver.execute_script("document.querySelector('.jp-OutputArea-output img')?.scrollIntoView(false)")
            driver.save_screenshot(str(shots / f"{stack}-1-running.png"))
        if out["clicked_at"] is None and epoch >= 1:
            stop_button(driver, shots, stack).click()
            out["clicked_at"] = (step, epoch)
            out["t"]["click"] = time.monotonic() - t0
            time.sleep(0.5)
            driver.save_screenshot(str(shots / f"{stack}-2-stop-clicked.png"))
        time.sleep(0.25)
    out["t"]["done"] = time.monotonic() - t0
    driver.execute_script("document.querySelector('.jp-OutputArea-output img')?.scrollIntoView(false)")
    driver.save_screenshot(str(shots / f"{stack}-3-done.png"))
    (shots / f"{stack}-page.txt").write_text(driver.execute_script(SAMPLE_JS)["text"])
    assert "final" in out, f"the notebook did not finish in 240 s; seen steps {out['steps']}; page text in {shots}"
    return out


def stop_button(driver, shots: Path, stack: str):
    """The "Stop after this epoch" button, waited for (the front end draws a widget a moment after its
    model arrives); when it never shows, the page as it was is saved and its text goes into the failure."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    xpath = "//button[normalize-space()='Stop after this epoch']"
    try:
        return WebDriverWait(driver, 30, poll_frequency=0.1).until(lambda d: d.find_element(By.XPATH, xpath))
    except TimeoutException:
        driver.save_screenshot(str(shots / f"{stack}-no-button.png"))
        text = driver.execute_script(SAMPLE_JS)["text"]
        (shots / f"{stack}-no-button.txt").write_text(text)
        widgets = driver.execute_script(
            "return [...document.querySelectorAll('.jp-OutputArea-output')].map(e => e.className + ': ' + "
            "e.innerHTML.slice(0, 300))"
        )
        raise AssertionError(
            f"no 'Stop after this epoch' button 30 s after an epoch ended ({stack}); the outputs:\n"
            + "\n".join(widgets)
            + f"\npage text:\n{text[-2000:]}"
        ) from None


@pytest.mark.parametrize("stack", ["ipykernel7", "colab"])
def test_dashboard_live_in_a_browser(stack, browser, tmp_path):
    t0 = time.monotonic()
    lab = start_lab(tmp_path, stack)
    try:
        seen = watch_and_stop(browser, lab, stack)
    finally:
        lab.close()
    seen["t"]["test"] = time.monotonic() - t0
    print(f"{stack}: {json.dumps({k: v for k, v in seen.items() if k in ('steps', 'clicked_at', 'final', 't')})}")
    assert "kernel stack: ipykernel " + ("7." if stack == "ipykernel7" else "6.17.1") in seen["text"]
    # the counter moved while the cell ran (several distinct steps seen before the FINAL line), and the figure
    # was redrawn (several distinct images)
    assert len(seen["steps"]) >= 4 and seen["steps"] == sorted(seen["steps"]), seen["steps"]
    assert len(seen["imgs"]) >= 2, "the figure was never redrawn while the cell ran"
    assert seen["xla"] and max(g for _c, _s, g in seen["xla"]) >= 1, "the XLA numbers (graphs compiled) never showed"
    # the click stopped the run at the end of the epoch it was made in
    step, epoch, per_epoch, total = seen["final"]
    assert seen["clicked_at"] is not None, "no epoch boundary passed before the run ended: nothing was clicked"
    said = [m for label in seen["labels"] if (m := re.fullmatch(r"stopping after epoch (\d+)", label))]
    assert said, f"the button's label says {seen['labels']}"
    click_epoch = int(said[0].group(1))  # the epoch the trainer was in when the click reached it
    assert click_epoch >= seen["clicked_at"][1], "the click reached the trainer before it was made?"
    assert step == per_epoch * (click_epoch + 1) < total and epoch == click_epoch + 1, (seen["final"], click_epoch)


# -- the book ----------------------------------------------------------------------------------------------

FIGURE_NOTEBOOK = [
    "# A figure for the book check\nOne executed cell that draws a figure, so the built site has an image to load.",
    "import io\nimport matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
    "from IPython.display import Image, display\n"
    "fig, ax = plt.subplots(figsize=(3, 2))\nax.plot([0, 1, 2], [2, 0, 1])\nbuf = io.BytesIO()\n"
    "fig.savefig(buf, format='png')\ndisplay(Image(buf.getvalue()))\nprint('figure drawn')",
]

PAGE_JS = """
const imgs = [...document.querySelectorAll('img')].map(i => ({src: i.src.slice(0, 80), ok: i.complete && i.naturalWidth > 0}));
const links = [...document.querySelectorAll('a[href]')].map(a => a.href);
return {title: document.title, imgs: imgs, links: links, text: document.body.innerText.slice(0, 20000)};
"""


def test_book_pages_figures_and_links(browser, tmp_path):
    """The book as built by `make book` (scripts/build_book.py), from cheap inputs: every course notebook as its
    source, plus one small notebook executed here (a figure). Every page loads, every img of the site loads
    (the Colab badges are online images: not checked, no network here), every link inside the site resolves."""
    import functools
    import http.server
    import threading

    import nbformat
    from nbclient import NotebookClient

    sys.path.insert(0, str(ROOT / "scripts"))
    import build_book

    executed, site = tmp_path / "executed", tmp_path / "site"
    executed.mkdir()
    md, code = FIGURE_NOTEBOOK
    fig_nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(md), nbformat.v4.new_code_cell(code)])
    src = tmp_path / "99_figure_check.ipynb"
    nbformat.write(fig_nb, src)
    NotebookClient(fig_nb, timeout=120, kernel_name="python3").execute()
    nbformat.write(fig_nb, executed / src.name)
    course = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    entries = build_book.build(course + [src], executed, site)
    assert [e["src"].name for e in entries] == [p.name for p in sorted(course, key=build_book.course_key)] + [src.name]

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        pages = ["index.html"] + [e["src"].stem + ".html" for e in entries]
        broken, seen_links, figures = [], set(), 0
        for page in pages:
            browser.get(base + page)
            time.sleep(0.3)
            got = browser.execute_script(PAGE_JS)
            assert "404" not in got["title"] and got["text"].strip(), f"{page} did not load: {got['title']}"
            ours = [i for i in got["imgs"] if i["src"].startswith((base, "data:"))]  # not the Colab badge (online)
            broken += [f"{page}: {i['src']}" for i in ours if not i["ok"]]
            figures += sum(i["ok"] for i in got["imgs"] if i["src"].startswith("data:image/png"))
            seen_links |= {u.split("#")[0] for u in got["links"] if u.startswith(base)}
            if page == "index.html":
                browser.save_screenshot(str(artifacts() / "book-index.png"))
                for e in entries:  # each under its own number, as the README names it (00 first)
                    num = e["src"].name.split("_")[0]
                    assert f"{num}\t{e['title']}" in got["text"], f"the index does not list {num} {e['title']}"
            if page == "99_figure_check.html":
                browser.save_screenshot(str(artifacts() / "book-figure-page.png"))
        assert not broken, f"images that did not load: {broken}"
        assert figures >= 1, "the executed notebook's figure is not in the book"
        dead = []
        for url in sorted(seen_links):
            try:
                urllib.request.urlopen(url, timeout=10).read()
            except OSError as e:
                dead.append(f"{url}: {e}")
        assert not dead, f"internal links that do not resolve: {dead}"
        assert len(seen_links) >= len(pages)
    finally:
        server.shutdown()
