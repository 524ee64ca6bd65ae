"""A headless Chromium driven over the DevTools protocol, on a pipe (no websocket library needed):
what tests/test_docs.py uses to load the built site, served from localhost, at 1280 and 390 px."""

from __future__ import annotations

import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path

from tests.deadlines import scaled
from tests.helpers import PYTHON


def find_chromium() -> str | None:
    return next(
        (
            path
            for name in ("chromium", "chromium-browser", "google-chrome")
            if (path := shutil.which(name))
        ),
        None,
    )


class Chromium:
    """A headless Chromium driven over --remote-debugging-pipe (fd 3 in, fd 4 out, NUL-separated
    JSON)."""

    def __init__(self, binary: str, profile_dir: Path):
        to_browser, self._to_browser = os.pipe()
        self._from_browser, from_browser = os.pipe()
        # Chromium expects the pipe on fds 3 and 4: a small Python trampoline moves the ends there
        # (from above 9, so that neither can overwrite the other) and becomes Chromium.
        to_browser, from_browser = (self._above_9(fd) for fd in (to_browser, from_browser))
        trampoline = (
            f"import os, sys; os.dup2({to_browser}, 3); os.dup2({from_browser}, 4); "
            "os.execv(sys.argv[1], sys.argv[1:])"
        )
        self.process = subprocess.Popen(
            [
                PYTHON,
                "-c",
                trampoline,
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--remote-debugging-pipe",
                "--no-first-run",
                f"--user-data-dir={profile_dir}",
                "--window-size=1280,720",
                "about:blank",
            ],
            pass_fds=(to_browser, from_browser),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser)
        os.close(from_browser)
        self._buffer, self._last_id, self.events, self.targets = b"", 0, [], {}

    @staticmethod
    def _above_9(fd: int) -> int:
        moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(fd)
        return moved

    def send(
        self,
        method: str,
        params: dict | None = None,
        session: str | None = None,
        timeout_s: float = 60,
    ) -> dict:
        self._last_id += 1
        message = {"id": self._last_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + scaled(timeout_s)
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._last_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("Chromium did not answer in time")
            if select.select([self._from_browser], [], [], left)[0]:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium exited with code {self.process.wait(10)}")
                self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def open(self, url: str) -> str:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        for domain in ("Page", "Runtime", "Network"):
            self.send(f"{domain}.enable", session=session)
        self.send("Page.navigate", {"url": url}, session=session)
        self.targets[session] = target
        return session

    def close_page(self, session: str) -> None:
        self.send("Target.closeTarget", {"targetId": self.targets.pop(session)})

    def evaluate(self, session: str, expression: str):
        reply = self.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session
        )
        return reply["result"].get("value")

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout_s=10)
            self.process.wait(timeout=10)
        except Exception:  # noqa: BLE001 - whatever happened, do not leave the browser running
            self.process.kill()
            self.process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


def shadow_svgs(node: dict, in_shadow: bool = False) -> list[dict]:
    """The <svg> elements inside shadow roots (mkdocs-material renders each mermaid diagram into a
    closed one)."""
    found = [node] if in_shadow and node.get("nodeName", "").lower() == "svg" else []
    for child in node.get("children", []):
        found += shadow_svgs(child, in_shadow)
    for root in node.get("shadowRoots", []):
        found += shadow_svgs(root, True)
    return found


def texts(node: dict) -> str:
    return (node.get("nodeValue") or "") + " ".join(
        texts(child) for child in node.get("children", [])
    )


def wait_for_diagrams(browser: Chromium, session: str, expected: int, timeout_s: float = 90) -> int:
    """Wait until the page has loaded and mkdocs-material has replaced its `expected` mermaid
    blocks."""
    deadline, rendered = time.monotonic() + scaled(timeout_s), 0
    while time.monotonic() < deadline:
        # -1 until the page has loaded: a page without diagrams must not count as done before then
        rendered = browser.evaluate(
            session,
            "document.readyState === 'complete' ? "
            "document.querySelectorAll('div.mermaid').length : -1",
        )
        # a diagram that fails to parse never renders
        if rendered == expected or script_errors(browser):
            break
        time.sleep(0.25)
    return rendered


def script_errors(browser: Chromium) -> list[str]:
    return [
        " ".join(
            e["params"]["exceptionDetails"]
            .get("exception", {})
            .get("description", str(e["params"]))
            .splitlines()[:3]
        )[:300]
        for e in browser.events
        if e.get("method") == "Runtime.exceptionThrown"
    ]
