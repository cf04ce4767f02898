"""Real-browser tests of notebooks: JupyterLab served headless on loopback, driven by Debian's Chromium.

Needs ``/usr/bin/chromium`` (``apt-get install chromium``) and the ``playwright`` package (its wheel
ships the driver; no browser download); tests marked :data:`needs_browser` are skipped, naming what is
missing, where either is absent.

Fixtures (import them into a test module): ``lab`` is the test run's one JupyterLab, with no kernel left from
an earlier test; ``page`` opens a fresh Chromium page per test. Helpers write a notebook, open it, run every
cell and take screenshots.

Example::

    from browser import lab, page, run_notebook

    def test_prints(lab, page):
        run_notebook(page, lab, "hello", ["print('hi')"])
        page.wait_for_selector("text=hi")
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import psutil
import pytest
from jupyter_kernel import TEST_ENVIRONMENT

if TYPE_CHECKING:
    from playwright.sync_api import Page

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).parent / "artifacts"
# JupyterLab's first-run chatter (news and update checks) would pop toasts over the screenshots
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False}
}


def _missing() -> str | None:
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is missing (pip install playwright)"
    return None


MISSING = _missing()
needs_browser = pytest.mark.skipif(MISSING is not None, reason=f"browser test: {MISSING}")


@dataclass
class JupyterLab:
    """A running JupyterLab server: where it listens, its token, and the directory it serves."""

    url: str
    token: str
    root_dir: Path
    process: subprocess.Popen
    log_path: Path

    def write_notebook(self, name: str, cells: list[str]) -> Path:
        """Write ``<root_dir>/<name>.ipynb`` with one code cell per source string, for the python3 kernel."""
        import nbformat

        notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
        notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        path = self.root_dir / f"{name}.ipynb"
        nbformat.write(notebook, path)
        return path

    def notebook_url(self, name: str) -> str:
        """``<name>.ipynb`` in a workspace of its own: no tab an earlier test opened comes back with it."""
        return f"{self.url}/lab/workspaces/{name}/tree/{name}.ipynb?token={self.token}"

    def api(self, path: str, method: str = "GET") -> Any:
        """The server's REST API: ``path`` (e.g. ``/api/kernels``) with ``method``; the JSON it answers, if any."""
        request = urllib.request.Request(
            f"{self.url}{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shut_down_kernels(self, timeout: float = 30.0) -> None:
        """End every kernel (and so its workers) and wait until none is left, as if the server were new."""
        for kernel in self.api("/api/kernels"):
            self.api(f"/api/kernels/{kernel['id']}", method="DELETE")
        deadline = time.monotonic() + timeout
        while self.api("/api/kernels") and time.monotonic() < deadline:
            time.sleep(0.2)

    def log_tail(self, characters: int = 4000) -> str:
        """The end of the server's (and its kernels') output, for failure messages."""
        return self.log_path.read_text(errors="replace")[-characters:]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_serving(lab: JupyterLab, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lab.process.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with {lab.process.returncode}:\n{lab.log_tail()}")
        try:
            with urllib.request.urlopen(f"{lab.url}/api/status?token={lab.token}", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"JupyterLab did not answer within {timeout} s:\n{lab.log_tail()}")


@contextmanager
def jupyter_lab(root_dir: Path, env: dict[str, str] | None = None, timeout: float = 60.0) -> Iterator[JupyterLab]:
    """Serve ``root_dir`` with JupyterLab on 127.0.0.1 (free port, random token, no browser) until the block ends.

    Its kernels run this interpreter; its settings, workspaces and runtime files live in private
    directories beside ``root_dir``, so the user's own Jupyter setup plays no part.
    """
    home = root_dir.parent / f"{root_dir.name}-jupyter"
    settings = home / "settings"
    for name, values in LAB_SETTINGS.items():
        (settings / name).parent.mkdir(parents=True, exist_ok=True)
        (settings / name).write_text(json.dumps(values))
    port, token = _free_port(), secrets.token_hex(16)
    log_path = home / "lab.log"
    command = [
        sys.executable, "-m", "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        "--ServerApp.allow_root=True",  # CI runs as root
        "--ServerApp.terminals_enabled=False",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root_dir}",
        f"--LabApp.user_settings_dir={settings}",
        f"--LabApp.workspaces_dir={home / 'workspaces'}",
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run commands without clicking menus
    ]  # fmt: skip
    environment = {
        **os.environ,
        **TEST_ENVIRONMENT,
        **(env or {}),
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_DATA_DIR": str(home / "data"),  # the environment's own kernels and extensions still count
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=environment, cwd=root_dir)
    lab = JupyterLab(f"http://127.0.0.1:{port}", token, root_dir, process, log_path)
    try:
        _wait_until_serving(lab, timeout)
        yield lab
    finally:
        process.terminate()  # the server shuts its kernels down, and they end their worker processes
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def chromium_page(width: int = 1280, height: int = 1000) -> Iterator[Page]:
    """A page of a fresh headless Chromium (Debian's, driven by Playwright)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


@pytest.fixture
def lab(lab_server: JupyterLab) -> Iterator[JupyterLab]:
    """The test run's one JupyterLab server (``lab_server`` in conftest.py, serving a temporary directory), with no
    kernel running when the test starts or after it ends; each notebook opens in a workspace of its own."""
    lab_server.shut_down_kernels()
    yield lab_server
    lab_server.shut_down_kernels()


@pytest.fixture
def page() -> Iterator[Page]:
    """A fresh Chromium page, 1280 × 1000."""
    with chromium_page() as new_page:
        yield new_page


def open_notebook(page: Page, lab: JupyterLab, name: str, timeout: float = 60.0) -> None:
    """Open ``<name>.ipynb`` in JupyterLab and wait until its kernel is idle."""
    page.goto(lab.notebook_url(name))
    page.wait_for_function(
        """() => {
            const widget = window.jupyterapp && window.jupyterapp.shell.currentWidget;
            const kernel = widget && widget.sessionContext && widget.sessionContext.session
                && widget.sessionContext.session.kernel;
            return kernel && kernel.status === "idle";
        }""",
        timeout=timeout * 1000,
    )


def run_all_cells(page: Page) -> None:
    """Run every cell of the current notebook (the menu's Run ▸ Run All Cells); returns at once."""
    # not awaited: the command's promise settles only when the last cell has run
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def run_notebook(page: Page, lab: JupyterLab, name: str, cells: list[str]) -> None:
    """Write ``<name>.ipynb`` with ``cells``, open it and run every cell; returns once the cells are started."""
    lab.write_notebook(name, cells)
    open_notebook(page, lab, name)
    run_all_cells(page)


def save_notebook(page: Page) -> None:
    """Save the current notebook (File ▸ Save), outputs included; returns once it is written."""
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")


def workers_under(pid: int) -> list[str]:
    """Command lines of the kit's worker processes descending from ``pid`` (the lab and its kernels)."""
    from flair_nbddp.worker.process_name import RANK_PREFIX

    found = []
    for process in psutil.Process(pid).children(recursive=True):
        try:
            if process.name().startswith(RANK_PREFIX):
                found.append(" ".join(process.cmdline()))
        except psutil.NoSuchProcess:
            continue
    return found


def screenshot(page: Page, name: str, selector: str | None = None) -> Path:
    """Save a PNG of the page (or of the first element matching ``selector``) as ``tests/artifacts/<name>.png``."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    target = page.locator(selector).first if selector else page
    target.screenshot(path=str(path))
    return path
