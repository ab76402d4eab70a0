"""A headless Chromium driven over the DevTools protocol, for the KV view's browser tests.

`Browser()` starts Chromium (Debian's `chromium` package; `make chromium` installs it)
with a fresh profile and talks to its page over a websocket: open a URL, evaluate
JavaScript, wait for a condition, save a screenshot. `chromium_path()` is None where no
Chromium is installed, and the tests skip with that reason.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

FLAGS = [
    "--headless",
    "--no-sandbox",  # root in a container has no user namespace for the sandbox
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


class Browser:
    def __init__(self, width: int = 1500, height: int = 1100) -> None:
        from websockets.sync.client import connect

        binary = chromium_path()
        if binary is None:
            raise RuntimeError("no Chromium found (make chromium installs it)")
        self._profile = tempfile.mkdtemp(prefix="pagedllm-chromium-")
        self._proc = subprocess.Popen(
            [
                binary,
                *FLAGS,
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port = self._wait_port()
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list").json()
        page = next(t for t in targets if t["type"] == "page")
        self._stack = contextlib.ExitStack()
        self._ws = self._stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=None))
        self._ids = itertools.count(1)
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def _wait_port(self) -> int:
        active = Path(self._profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"Chromium exited with status {self._proc.returncode}")
            if active.exists():
                lines = active.read_text().split()
                if lines:
                    return int(lines[0])
            time.sleep(0.05)
        raise RuntimeError("Chromium did not open its DevTools port")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self._ws.recv(timeout=60))
            if reply.get("id") == msg_id:  # anything else is an event nobody asked for
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str) -> Any:
        """Poll until `expression` is truthy; its value."""
        deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(expression)
            except RuntimeError:
                value = None  # the page is still loading
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"the page never showed {what}: {expression}")

    def screenshot(self, path: Path) -> Path:
        """The whole page, below the fold too."""
        height = int(self.evaluate("document.documentElement.scrollHeight"))
        width = int(self.evaluate("document.documentElement.scrollWidth"))
        shot = self.call(
            "Page.captureScreenshot",
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        try:
            self._stack.close()
        finally:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
