"""A real IPython kernel for tests: run code in it and collect everything it publishes.

The kernel runs this interpreter (``sys.executable``) with ``FLAIR_NBDDP_DEVICE=cpu``,
``FLAIR_NBDDP_PROCESSES=2`` and ``HF_HUB_OFFLINE=1``, like the rest of the suite. Everything a cell
publishes on IOPub is gathered into an :class:`ExecutionResult` (streams, rich outputs with display
updates applied, the error), and every ipywidgets comm is tracked kernel-wide in
:attr:`KernelSession.widgets`, since widget updates can come from background threads and after the
cell ended.

Example::

    with running_kernel() as kernel:
        result = kernel.execute("import ipywidgets as w; w.IntSlider(3)")
        [model.state["value"] for model in kernel.widgets.values() if model.model_name == "IntSliderModel"]  # [3]

Interrupting a cell half-way::

    msg_id = kernel.submit("import time; time.sleep(60)")
    kernel.collect(msg_id, timeout=10, until=lambda: kernel.widgets_with_class("nbddp-dashboard"))
    kernel.interrupt()
    result = kernel.collect(msg_id, timeout=30)
    assert result.error["ename"] == "KeyboardInterrupt"
"""

from __future__ import annotations

import os
import queue
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import KernelManager

TEST_ENVIRONMENT = {"FLAIR_NBDDP_DEVICE": "cpu", "FLAIR_NBDDP_PROCESSES": "2", "HF_HUB_OFFLINE": "1"}


@dataclass
class WidgetModel:
    """One ipywidgets model as the kernel described it: its state now, at creation, and every update in order."""

    comm_id: str
    state: dict[str, Any]
    state_at_open: dict[str, Any]
    updates: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False

    @property
    def model_name(self) -> str:
        """E.g. ``"FloatProgressModel"``, ``"HTMLModel"``, ``"VBoxModel"``."""
        return self.state.get("_model_name", "")

    @property
    def classes(self) -> tuple[str, ...]:
        """The CSS classes given with ``widget.add_class``."""
        return tuple(self.state.get("_dom_classes", ()))

    def history(self, name: str) -> list[Any]:
        """Every value the trait ``name`` had: the one at creation, then each update that set it."""
        opening = [self.state_at_open[name]] if name in self.state_at_open else []
        return opening + [update[name] for update in self.updates if name in update]


@dataclass
class ExecutionResult:
    """What one ``execute_request`` produced.

    Attributes:
        msg_id: the request's id.
        stdout, stderr: the stream text, concatenated.
        outputs: rich outputs (``display_data``/``execute_result``) as ``{"output_type", "data", "metadata",
            "display_id"}``; an ``update_display_data`` replaces the ``data`` of the output with its display
            id, as a saved notebook would hold it.
        error: ``{"ename", "evalue", "traceback"}`` if the cell raised.
        reply: the ``execute_reply`` content (``status`` is ``"ok"``, ``"error"`` or ``"aborted"``).
        done: the kernel went idle after this request and replied to it.
    """

    msg_id: str
    stdout: str = ""
    stderr: str = ""
    outputs: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None
    reply: dict[str, Any] | None = None
    idle: bool = False

    @property
    def done(self) -> bool:
        return self.idle and self.reply is not None

    def data(self, mime_type: str) -> list[Any]:
        """The ``mime_type`` part of every rich output that has one, e.g. ``data("text/plain")``."""
        return [output["data"][mime_type] for output in self.outputs if mime_type in output["data"]]


class _ThisPython(KernelSpecManager):
    """A kernel spec of this very interpreter, whatever kernels are installed elsewhere."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(
            argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            display_name="Python (tests)",
            language="python",
            name=kernel_name,
        )


class KernelSession:
    """A started kernel and its client; made by :func:`running_kernel`."""

    def __init__(self, manager: KernelManager) -> None:
        self.manager = manager
        self.client = manager.client()
        self.widgets: dict[str, WidgetModel] = {}
        self._results: dict[str, ExecutionResult] = {}

    def submit(self, code: str) -> str:
        """Send ``code`` for execution and return the request's ``msg_id`` at once."""
        msg_id = self.client.execute(code, allow_stdin=False)
        self._results[msg_id] = ExecutionResult(msg_id)
        return msg_id

    def collect(self, msg_id: str, timeout: float = 60.0, until: Callable[[], bool] | None = None) -> ExecutionResult:
        """Gather the kernel's messages until the request is done, or ``until()`` holds after a receive.

        Returns the request's result so far. May be called again for the same ``msg_id`` to go on collecting (e.g. after :meth:`interrupt`).

        Raises:
            TimeoutError: not done within ``timeout`` seconds; the message holds the output so far.
        """
        result = self._results[msg_id]
        deadline = time.monotonic() + timeout
        while not result.done:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"the cell did not finish within {timeout} s; stdout so far:\n{result.stdout[-3000:]}\n"
                    f"stderr so far:\n{result.stderr[-3000:]}"
                )
            self._receive(min(remaining, 0.1))
            if until is not None and until():
                break
        return result

    def printed(self, msg_id: str, text: str, timeout: float = 60.0) -> ExecutionResult:
        """Gather the request's messages until ``text`` is in its stdout (the cell may go on).

        Raises:
            AssertionError: the cell finished, or ``timeout`` passed, without printing it.
        """
        result = self.collect(msg_id, timeout, until=lambda: text in self._results[msg_id].stdout)
        assert text in result.stdout, f"{text!r} never appeared; stdout:\n{result.stdout[-3000:]}"
        return result

    def execute(self, code: str, timeout: float = 60.0) -> ExecutionResult:
        """Run ``code`` and wait until the kernel is idle again; see :class:`ExecutionResult`."""
        return self.collect(self.submit(code), timeout)

    def interrupt(self) -> None:
        """Interrupt the kernel, as the frontend's ■ button does (SIGINT to the kernel process)."""
        self.manager.interrupt_kernel()

    def widgets_with_class(self, css_class: str) -> list[WidgetModel]:
        """Every widget model that carries ``css_class`` (``widget.add_class``), oldest first."""
        return [model for model in self.widgets.values() if css_class in model.classes]

    def _receive(self, timeout: float) -> None:
        self._drain(self.client.get_shell_msg, self._on_reply, 0)
        self._drain(self.client.get_iopub_msg, self._on_iopub, timeout)

    @staticmethod
    def _drain(get: Callable[..., dict], handle: Callable[[dict], None], timeout: float) -> None:
        """Handle every message waiting on one channel, waiting up to ``timeout`` for the first."""
        try:
            handle(get(timeout=timeout))
            while True:
                handle(get(timeout=0))
        except queue.Empty:
            pass

    def _on_reply(self, message: dict) -> None:
        result = self._results.get(message["parent_header"].get("msg_id"))
        if result is not None and message["msg_type"] == "execute_reply":
            result.reply = message["content"]

    def _on_iopub(self, message: dict) -> None:
        kind, content = message["msg_type"], message["content"]
        if kind.startswith("comm_"):
            self._on_comm(kind, content)
            return
        result = self._results.get(message["parent_header"].get("msg_id"))
        if result is None:
            return
        if kind == "stream":
            if content["name"] == "stdout":
                result.stdout += content["text"]
            else:
                result.stderr += content["text"]
        elif kind in ("display_data", "execute_result"):
            display_id = content.get("transient", {}).get("display_id")
            output = {"output_type": kind, "data": content["data"], "metadata": content["metadata"]}
            result.outputs.append({**output, "display_id": display_id})
        elif kind == "update_display_data":
            display_id = content.get("transient", {}).get("display_id")
            for output in result.outputs:
                if display_id is not None and output["display_id"] == display_id:
                    output["data"], output["metadata"] = content["data"], content["metadata"]
        elif kind == "error":
            result.error = {key: content[key] for key in ("ename", "evalue", "traceback")}
        elif kind == "status" and content["execution_state"] == "idle":
            result.idle = True

    def _on_comm(self, kind: str, content: dict) -> None:
        comm_id, data = content["comm_id"], content.get("data", {})
        if kind == "comm_open":
            state = dict(data.get("state", {}))
            self.widgets[comm_id] = WidgetModel(comm_id, state, dict(state))
            return
        model = self.widgets.get(comm_id)
        if model is None:
            return
        if kind == "comm_close":
            model.closed = True
        elif data.get("method") == "update":
            model.updates.append(data["state"])
            model.state.update(data["state"])


@contextmanager
def running_kernel(
    env: dict[str, str] | None = None, cwd: str | Path | None = None, startup_timeout: float = 60.0
) -> Iterator[KernelSession]:
    """Start a kernel of this interpreter, yield a :class:`KernelSession`, and shut the kernel down.

    Args:
        env: variables added to this process's environment and :data:`TEST_ENVIRONMENT`.
        cwd: the kernel's working directory (default: this one).
        startup_timeout: seconds the kernel may take to answer its first request.
    """
    if os.environ.get("FLAIR_NBDDP_TEST_TIER") == "fast":
        raise AssertionError("this fast-tier test started a Jupyter kernel: mark it @pytest.mark.kernel")
    with tempfile.TemporaryDirectory(prefix="kernel-") as sockets:
        # IPC sockets in a private directory: no TCP port is opened, and no other user can connect
        manager = KernelManager(
            kernel_name="python3", kernel_spec_manager=_ThisPython(), transport="ipc", ip=os.path.join(sockets, "ipc")
        )
        manager.start_kernel(env={**os.environ, **TEST_ENVIRONMENT, **(env or {})}, cwd=str(cwd or os.getcwd()))
        session = KernelSession(manager)
        try:
            session.client.start_channels()
            session.client.wait_for_ready(timeout=startup_timeout)
            yield session
        finally:
            session.client.stop_channels()
            manager.shutdown_kernel(now=True)
