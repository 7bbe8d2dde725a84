"""llamapy-server's chat page (llamapy/server/web/chat.html) in headless Chromium (Debian's
`chromium`, installed by .ci/run), driven over the DevTools protocol: the page loads from
`/`, a message typed into it and sent with Enter streams back an answer, which the test reads
from the page: greedy, so it must be the answer the API gives the same request. A screenshot
of the page is a whole PNG of the window, not blank."""
from __future__ import annotations

import base64
import itertools
import json
import shutil
import socket
import struct
import subprocess
import time
import urllib.request

import pytest

from test_server import ServerProcess

websocket = pytest.importorskip("websocket")  # websocket-client: the test extra
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
WIDTH, HEIGHT = 1000, 700


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Browser:
    """Headless Chromium with one page, driven by DevTools protocol commands."""

    def __init__(self, profile) -> None:
        port = free_port()
        self.proc = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      f"--remote-debugging-port={port}", f"--user-data-dir={profile}",
                                      f"--window-size={WIDTH},{HEIGHT}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as reply:
                    pages = [t for t in json.loads(reply.read()) if t["type"] == "page"]
                if pages:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("chromium did not start")
            time.sleep(0.2)
        self.ws = websocket.create_connection(pages[0]["webSocketDebuggerUrl"], timeout=60, suppress_origin=True)
        self.ids = itertools.count(1)

    def call(self, method: str, **params) -> dict:
        sent = next(self.ids)
        self.ws.send(json.dumps({"id": sent, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == sent:
                assert "error" not in message, message
                return message["result"]

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"never true: {expression}")

    def close(self) -> None:
        self.ws.close()
        self.proc.kill()
        self.proc.wait(timeout=30)


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data.endswith(b"IEND\xaeB`\x82")
    return struct.unpack(">II", data[16:24])


def test_the_page_streams_an_answer_in_headless_chromium(stories_path, tmp_path):
    server = ServerProcess("-m", str(stories_path), "-c", "512", "-np", "1", "-t", "1", "--chat-template", "chatml")
    browser = Browser(tmp_path / "profile")
    try:
        browser.call("Page.enable")
        browser.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=False)
        browser.call("Page.navigate", url=f"http://{server.host}:{server.port}/")
        browser.wait_for("document.readyState === 'complete' && document.getElementById('model').textContent !== '…'")
        assert browser.js("document.title") == "llamapy"
        browser.js("document.getElementById('temperature').value = '0';"
                   "document.getElementById('max_tokens').value = '24'; true")
        browser.js("document.getElementById('input').focus(); true")
        browser.call("Input.insertText", text="Tell me a story about a cat.")
        for kind in ("keyDown", "keyUp"):
            browser.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)
        browser.wait_for("document.querySelector('.msg.assistant') && "
                         "document.querySelector('.msg.assistant').dataset.done === '1'")
        answer = browser.js("document.querySelector('.msg.assistant').firstChild.textContent")
        finish = browser.js("document.querySelector('.msg.assistant').dataset.finish")
        assert browser.js("document.querySelector('.msg.user').textContent") == "Tell me a story about a cat."
        status, direct = server.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Tell me a story about a cat."}], "temperature": 0,
            "max_tokens": 24})
        assert status == 200
        assert answer and answer == direct["choices"][0]["message"]["content"]
        assert finish == direct["choices"][0]["finish_reason"]
        shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
        assert png_size(shot) == (WIDTH, HEIGHT) and len(shot) > 10_000
    finally:
        browser.close()
        server.stop()


def test_the_page_is_served_without_the_api_key(stories_path):
    """The page asks for the key itself; everything else still needs it."""
    server = ServerProcess("-m", str(stories_path), "-c", "256", "-np", "1", "-t", "1", "--api-key", "secret")
    try:
        status, page = server.request("GET", "/")
        assert status == 200 and "<title>llamapy</title>" in page and "http://" not in page.split("<script>")[1]
        assert server.request("GET", "/v1/models")[0] == 401
    finally:
        server.stop()
