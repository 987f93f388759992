"""The dashboard at / and the JSON it polls: the state endpoint mirrors engine.snapshot();
in headless Chromium (Debian's `chromium`, driven over the DevTools protocol) the page loads,
shows each worker's pool, and updates after a request. Bounded: PAGE_S_MAX per wait."""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
import os
import subprocess

import httpx
import pytest

from api.serve.app import create_app
from tests.api_cases import LiveServer, protocol_engine, tiny_chat_model, wait_until  # noqa: F401

PAGE_S_MAX = 20.0
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def live(tiny_chat_model):  # noqa: F811
    engine = protocol_engine(tiny_chat_model)
    with LiveServer(create_app(engine)) as server:
        yield server, engine


def test_the_state_endpoint_mirrors_the_snapshot(live):
    server, engine = live
    httpx.post(f"{server.url}/v1/completions", json={"prompt": "s", "max_tokens": 2}, timeout=30)
    state = httpx.get(f"{server.url}/v1/kvproof/state", timeout=10).json()
    snapshot = engine.snapshot()
    assert state["model"] == engine.model_name and state["context_length"] == 512
    assert state["pools"] == [dataclasses.asdict(pool) for pool in snapshot.pools]
    assert all(p["free"] == p["pages"] and p["writes_in_flight"] == 0 for p in state["pools"])
    assert [r["request_id"] for r in state["recent"]] == [r.request_id for r in snapshot.recent]
    assert state["recent"][-1]["timeline"] == [list(step) for step in snapshot.recent[-1].timeline]
    assert state["outcomes"] == snapshot.outcomes


def test_the_page_is_served_as_html_that_polls_the_state(live):
    server, _engine = live
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'fetch("/v1/kvproof/state"' in page.text and 'id="pools"' in page.text


class DevTools:
    """The smallest DevTools-protocol client: one page, commands by id."""

    def __init__(self, socket):
        self.socket = socket
        self.next_id = 0

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.socket.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=PAGE_S_MAX))
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression,
                         returnByValue=True)["result"].get("value")


@pytest.fixture
def browser(tmp_path):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    profile = tmp_path / "profile"
    process = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        wait_until(lambda: port_file.is_file() and port_file.read_text().strip(), PAGE_S_MAX,
                   "chromium's DevTools port")
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(t for t in targets if t["type"] == "page")
        from websockets.sync.client import connect

        with connect(page["webSocketDebuggerUrl"], max_size=None,
                     open_timeout=PAGE_S_MAX) as socket:
            yield DevTools(socket)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


PAGE_STATE = """JSON.stringify({
  polls: Number(document.body.dataset.polls || 0),
  pools: [...document.querySelectorAll('#pools tbody tr')].map(
    r => [r.dataset.worker, Number(r.dataset.free), Number(r.dataset.pages)]),
  recent: [...document.querySelectorAll('#recent tbody tr')].map(
    r => [Number(r.dataset.requestId), r.children[1].textContent, r.children[2].textContent]),
  status: document.getElementById('status').textContent})"""


def test_the_page_shows_the_pools_and_updates_after_a_request(live, browser, tmp_path):
    server, engine = live
    browser.call("Page.enable")
    browser.call("Page.navigate", url=f"{server.url}/")

    def page_state() -> dict:
        value = browser.evaluate(PAGE_STATE)
        return json.loads(value) if value else {"polls": 0}

    wait_until(lambda: page_state()["polls"] >= 1, PAGE_S_MAX, "the first poll")
    before = page_state()
    assert before["pools"] == [[p.worker, p.pages, p.pages] for p in engine.snapshot().pools]
    assert before["status"].startswith("serving")
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "dashboard"}], "max_tokens": 3})
    assert reply.status_code == 200
    newest = engine.snapshot().recent[-1].request_id
    wait_until(lambda: any(r[0] == newest for r in page_state().get("recent", [])), PAGE_S_MAX,
               "the page to show the new request")
    after = page_state()
    row = next(r for r in after["recent"] if r[0] == newest)
    assert row[1] == "Ok"
    assert all(action in row[2] for _at, action in engine.snapshot().recent[-1].timeline)
    assert after["polls"] > before["polls"]
    shot = browser.call("Page.captureScreenshot", format="png")["data"]
    (tmp_path / "dashboard.png").write_bytes(base64.b64decode(shot))
    if os.environ.get("KVPROOF_DASHBOARD_PNG"):  # for a person to look at after the run
        with open(os.environ["KVPROOF_DASHBOARD_PNG"], "wb") as picture:
            picture.write(base64.b64decode(shot))
