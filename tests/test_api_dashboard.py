"""The dashboard at / and the JSON it polls: the state endpoint mirrors engine.snapshot();
in headless Chromium (Debian's `chromium`, driven over the DevTools protocol) the page loads,
shows each worker's pool, and updates after a request. For an operator: its first paint
already shows the state (the state endpoint held back), requests turned away are counted on
it, requests are named as the protocol names them, a client's cancel, a success and an error
are drawn apart, timelines wrap to their last step, and a chart keeps pool occupancy,
throughput and TTFT over time. Bounded: PAGE_S_MAX per wait."""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
import os
import subprocess

import httpx
import pytest

from api.serve.app import INITIAL_STATE, create_app, dashboard_html
from engine.sampling import SamplingParams
from engine.service import Finished, GenerationRequest
from tests.api_cases import (LiveServer, protocol_engine, tiny_chat_model,  # noqa: F401
                             wait_settled, wait_until)

PAGE_S_MAX = 20.0
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def protocol_name(timeline) -> str:
    """The request's name as the protocol's own trace labels write it: Arrive(r2, 7)."""
    first = timeline[0][1]
    assert first.startswith("Arrive(")
    return first[len("Arrive("):].split(",")[0]


@pytest.fixture(scope="module")
def live(tiny_chat_model):  # noqa: F811
    engine = protocol_engine(tiny_chat_model)
    with LiveServer(create_app(engine)) as server:
        yield server, engine


def test_the_state_endpoint_mirrors_the_snapshot(live):
    server, engine = live
    httpx.post(f"{server.url}/v1/completions", json={"prompt": "s", "max_tokens": 2}, timeout=30)
    wait_settled(engine)  # the release can trail the answer (it waits for the final word)
    state = httpx.get(f"{server.url}/v1/kvproof/state", timeout=10).json()
    snapshot = engine.snapshot()
    assert state["model"] == engine.model_name and state["context_length"] == 512
    assert state["pools"] == [dataclasses.asdict(pool) for pool in snapshot.pools]
    assert all(p["free"] == p["pages"] and p["writes_in_flight"] == 0 for p in state["pools"])
    assert [r["request_id"] for r in state["recent"]] == [r.request_id for r in snapshot.recent]
    assert state["recent"][-1]["timeline"] == [list(step) for step in snapshot.recent[-1].timeline]
    assert state["outcomes"] == snapshot.outcomes
    assert [r["name"] for r in state["recent"]] == [protocol_name(r.timeline)
                                                    for r in snapshot.recent]
    assert state["http"]["responses"] == {"200": 1}
    assert state["http"]["time_to_first_token_count"] == 1
    assert 0 < state["http"]["time_to_first_token_s_sum"] < 30


def test_the_page_is_served_as_html_that_polls_the_state(live):
    server, _engine = live
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'fetch("/v1/kvproof/state"' in page.text and 'id="pools"' in page.text
    embedded = page.text.split(INITIAL_STATE.replace("null</script>", ""))[1]
    state = json.loads(embedded.split("</script>")[0])
    assert state["model"] == _engine.model_name and state["pools"][0]["worker"] == "prefill-0"


def test_the_embedded_state_cannot_end_its_script_element():
    page = dashboard_html({"model": "</script><script>alert(1)</script>"})
    assert "alert" in page and "</script><script>alert" not in page
    embedded = page.split(INITIAL_STATE.replace("null</script>", ""))[1].split("</script>")[0]
    assert json.loads(embedded) == {"model": "</script><script>alert(1)</script>"}


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


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One headless Chromium for the module's tests (each navigates its one page)."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    profile = tmp_path_factory.mktemp("chromium") / "profile"
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


def open_page(browser: DevTools, url: str) -> None:
    """Navigate and wait for the new document's load event (not the last page's: the
    browser is shared, so each test opens its own URL)."""
    browser.call("Page.navigate", url=url)
    wait_until(lambda: browser.evaluate("location.href + ' ' + document.readyState")
               == url + " complete", PAGE_S_MAX, f"{url} to load")


PAGE_STATE = """JSON.stringify({
  polls: Number(document.body.dataset.polls || 0),
  pools: [...document.querySelectorAll('#pools tbody tr')].map(
    r => [r.dataset.worker, Number(r.dataset.free), Number(r.dataset.pages)]),
  recent: [...document.querySelectorAll('#recent tbody tr')].map(
    r => [Number(r.dataset.requestId), r.children[1].textContent, r.children[2].textContent]),
  status: document.getElementById('status').textContent})"""


def test_the_page_shows_the_pools_and_updates_after_a_request(live, browser, tmp_path):
    server, engine = live
    open_page(browser, f"{server.url}/?poll_ms=100")

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


# The page's operator view, read back as the test compares it: counts by name per panel,
# each request row's name, outcome kind, computed colour and whether its last step is in
# view, and the chart's points per series.
OPERATOR_VIEW = """JSON.stringify({
  polls: Number(document.body.dataset.polls || 0),
  status: document.getElementById('status').textContent,
  scrollsSideways: document.documentElement.scrollWidth > document.documentElement.clientWidth,
  pools: document.querySelectorAll('#pools tbody tr').length,
  counts: Object.fromEntries(['rejects', 'responses', 'refusals'].map(id => [id,
    Object.fromEntries([...document.querySelectorAll('#' + id + ' [data-count]')].map(
      e => [e.dataset.name, Number(e.dataset.count)]))])),
  rows: [...document.querySelectorAll('#recent tbody tr')].map(r => {
    const steps = [...r.querySelectorAll('.step')];
    const last = steps[steps.length - 1];
    return {id: Number(r.dataset.requestId), name: r.children[0].textContent,
            outcome: r.children[1].textContent, kind: r.dataset.kind,
            color: getComputedStyle(r.children[1]).color,
            lastStep: last ? last.textContent : '',
            inView: steps.length > 0 && steps.every(
              s => s.getBoundingClientRect().right <= document.documentElement.clientWidth)};
  }),
  chart: Object.fromEntries([...document.querySelectorAll('#chart [data-series]')].map(
    e => [e.dataset.series, Number(e.dataset.points)]))})"""
# A prefill pool (32 tokens) below the context (PoolBelowContext): a 40-token prompt is
# rejected by the prefill (ErrTooLong, an error the engine really gives); two requests fill
# the admission queue while the engine is not started, so every HTTP request then is a 503.
OPERATOR = dict(context_length=64, page_tokens=4, prefill_pool_tokens=32,
                decode_pool_tokens=64, bugs={"PoolBelowContext"}, max_queued=2)
CAPACITY_REJECTS = 3
WIDTH_PX = 800


@pytest.fixture
def operator(tiny_chat_model):  # noqa: F811
    engine = protocol_engine(tiny_chat_model, **OPERATOR)
    app = create_app(engine, start_engine=False)
    with LiveServer(app) as server:
        yield server, engine, app


def test_the_first_paint_shows_the_state_before_any_poll(live, browser, tmp_path):
    """The state endpoint is held back (DevTools' Fetch domain pauses it): whatever the
    page shows at its load event came with the page itself."""
    server, engine = live
    browser.call("Fetch.enable", patterns=[{"urlPattern": "*/v1/kvproof/state*"}])
    browser.call("Emulation.setDeviceMetricsOverride", width=WIDTH_PX, height=700,
                 deviceScaleFactor=1, mobile=False)
    try:
        open_page(browser, f"{server.url}/?poll_ms=1000")
        view = json.loads(browser.evaluate(OPERATOR_VIEW))
        shot = browser.call("Page.captureScreenshot", format="png")["data"]
        (tmp_path / "first-paint.png").write_bytes(base64.b64decode(shot))
    finally:
        browser.call("Fetch.disable")
    assert view["polls"] == 0
    assert view["status"].startswith("serving") and "loading" not in view["status"]
    assert view["pools"] == len(engine.snapshot().pools) == 2
    assert view["counts"]["rejects"] == {}


def test_the_page_shows_an_operator_what_was_turned_away_and_how_requests_ended(
        operator, browser, tmp_path):
    server, engine, app = operator
    browser.call("Emulation.setDeviceMetricsOverride", width=WIDTH_PX, height=900,
                 deviceScaleFactor=1, mobile=False)
    open_page(browser, f"{server.url}/?poll_ms=100")
    events = {"waiting": [], "cancelled": []}
    waiting = GenerationRequest((5, 6, 7), SamplingParams(max_tokens=2))
    engine.submit(waiting, events["waiting"].append)
    cancelled = engine.submit(waiting, events["cancelled"].append)
    engine.abort(cancelled)  # the client goes away before the engine even starts
    chat = {"messages": [{"role": "user", "content": "op"}], "max_tokens": 3}
    for _ in range(CAPACITY_REJECTS):
        assert httpx.post(f"{server.url}/v1/chat/completions", json=chat,
                          timeout=30).status_code == 503
    app.state.lifetime.start()
    wait_until(lambda: all(e and isinstance(e[-1], Finished) for e in events.values()),
               PAGE_S_MAX, "the two queued requests to end")
    assert [e[-1].outcome for e in events.values()] == ["Ok", "Gone"]
    too_long = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"prompt": "x" * 40, "max_tokens": 4})
    assert too_long.status_code == 400
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat,
                      timeout=30).status_code == 200
    snapshot = wait_settled(engine)
    assert snapshot.rejects == {"capacity": CAPACITY_REJECTS, "too long": 1}
    assert snapshot.outcomes == {"Ok": 2, "Gone": 1, "ErrTooLong": 1}

    def view() -> dict:
        value = browser.evaluate(OPERATOR_VIEW)
        return json.loads(value) if value else {"rows": [], "chart": {}}

    answers = {"503": CAPACITY_REJECTS, "400": 1, "200": 1}

    def settled(shown: dict) -> bool:  # a poll after the last answer, and a few samples
        return (shown["counts"]["responses"] == answers and len(shown["rows"]) == 4
                and "live" not in [row["outcome"] for row in shown["rows"]]
                and shown["chart"].get("ttft", 0) >= 1 and shown["chart"]["occupancy"] >= 4
                and shown["chart"].get("throughput", 0) >= 3)

    seen = [{}]

    def shows_settled() -> bool:
        seen[0] = view()
        return settled(seen[0])

    wait_until(shows_settled, PAGE_S_MAX, "the page to show the settled state",
               last_seen=lambda: {k: seen[0].get(k) for k in ("counts", "chart")} | {
                   "rows": [(row["name"], row["outcome"]) for row in seen[0]["rows"]]})
    shown = view()
    assert shown["counts"]["rejects"] == snapshot.rejects
    assert shown["counts"]["refusals"] == engine.snapshot().refusals
    server_names = {r.request_id: protocol_name(r.timeline) for r in snapshot.recent}
    assert {row["id"]: row["name"] for row in shown["rows"]} == server_names
    assert sorted(server_names.values()) == ["r1", "r2", "r3", "r4"]
    kinds = {row["outcome"]: (row["kind"], row["color"]) for row in shown["rows"]}
    assert {outcome: kind for outcome, (kind, _) in kinds.items()} == {
        "Ok": "ok", "Gone": "gone", "ErrTooLong": "error"}
    assert len({kinds[o][1] for o in ("Ok", "Gone", "ErrTooLong")}) == 3  # three colours
    assert kinds["ErrTooLong"][1] == "rgb(187, 0, 0)"  # the page's red for errors
    assert all(row["inView"] and row["lastStep"].endswith(")") for row in shown["rows"])
    assert not shown["scrollsSideways"]
    ok = next(r for r in snapshot.recent if r.outcome == "Ok" and len(r.timeline) > 12)
    last = next(row for row in shown["rows"] if row["id"] == ok.request_id)["lastStep"]
    assert last.endswith(ok.timeline[-1][1])  # the end of a long timeline, in view
    assert shown["chart"]["throughput"] >= 3 and shown["chart"]["ttft"] >= 1
    page = browser.call("Page.getLayoutMetrics")["cssContentSize"]
    shot = browser.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                        clip={"x": 0, "y": 0, "width": WIDTH_PX, "height": page["height"],
                              "scale": 1})["data"]  # the whole page
    (tmp_path / "operator.png").write_bytes(base64.b64decode(shot))
    if os.environ.get("KVPROOF_DASHBOARD_PNG"):  # for a person to look at after the run
        with open(os.environ["KVPROOF_DASHBOARD_PNG"].replace(".png", "-operator.png"),
                  "wb") as picture:
            picture.write(base64.b64decode(shot))
    # A core refusal needs a fault racing an abort (tests/test_engine_workers.py makes one):
    # the page is given one in a real state, drawn in the same turn as it is read back.
    state = httpx.get(f"{server.url}/v1/kvproof/state", timeout=10).json()
    refusals = {"the client is not waiting": 2}
    drawn = json.loads(browser.evaluate(
        f"draw({json.dumps(state | {'refusals': refusals})}), {OPERATOR_VIEW}"))
    assert drawn["counts"]["refusals"] == refusals


PREFIX_VIEW = """JSON.stringify({
  hidden: document.querySelector('#prefix-section').hidden,
  decode: Object.fromEntries([...document.querySelectorAll('#prefix-decode .count')].map(
    s => [s.dataset.name, Number(s.dataset.count)])),
  prefill: Object.fromEntries([...document.querySelectorAll('#prefix-prefill .count')].map(
    s => [s.dataset.name, Number(s.dataset.count)])),
  shared: Object.fromEntries([...document.querySelectorAll('#prefix-shared-guards .count')]
    .map(s => [s.dataset.name, Number(s.dataset.count)])),
  sharedText: document.querySelector('#prefix-shared-guards').textContent,
  tenants: [...document.querySelectorAll('#prefix-tenants tbody tr')].map(r => [
    r.dataset.tenant, Number(r.dataset.promptPages), Number(r.dataset.hitPages),
    Number(r.dataset.hitRate), Number(r.dataset.sharedGuardTrips)]),
  tenantsMore: document.querySelector('#prefix-tenants-more').textContent})"""


def test_the_page_shows_each_sides_prefix_cache(tiny_chat_model, browser, live):  # noqa: F811
    """With the prefix cache on, the page shows decode's and the prefill's counters, hit
    rates and cached pages as the state has them: a prompt of 4 full pages sent twice
    hits all 4 at both sides the second time (50%); without a cache the section is hidden.
    Its tenant table (here the one default tenant: no keys) and shared-page guard trips are
    the state's too; a state with a trip and more tenants than rows draws them, the
    tenants with the most prompt pages first."""
    from api.serve.app import create_app as app_for

    open_page(browser, f"{live[0].url}/?poll_ms=100")  # a server without a cache
    wait_until(lambda: json.loads(browser.evaluate(PREFIX_VIEW) or "{}").get("hidden"),
               PAGE_S_MAX, "the prefix section hidden")
    engine = protocol_engine(tiny_chat_model, prefix_cache=True)
    prompt = "You are a careful assistant. Answer in one short sentence, then stop: "
    with LiveServer(app_for(engine)) as server:
        for _ in range(2):
            reply = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
                "prompt": prompt, "max_tokens": 3, "temperature": 0})
            assert reply.status_code == 200, reply.text
            wait_settled(engine)
        snapshot = wait_settled(engine)
        open_page(browser, f"{server.url}/?poll_ms=100")
        shown = [{}]

        def drawn() -> bool:
            shown[0] = json.loads(browser.evaluate(PREFIX_VIEW) or "{}")
            return not shown[0].get("hidden", True) and shown[0]["decode"].get("hit_pages")
        wait_until(drawn, PAGE_S_MAX, "the prefix section", last_seen=lambda: shown[0])
        state = httpx.get(f"{server.url}/v1/kvproof/state", timeout=10).json()
    decode, prefill = shown[0]["decode"], shown[0]["prefill"]
    assert {k: decode[k] for k in snapshot.prefix} == snapshot.prefix
    assert {k: prefill[k] for k in snapshot.prefill_cache} == snapshot.prefill_cache
    assert (decode["hit_pages"], decode["reserved_prompt_pages"], decode["hit rate %"]) == (
        4, 8, 50)
    assert (prefill["hit_pages"], prefill["hit rate %"]) == (4, 50)
    assert decode["cached pages"] == sum(p.cached for p in snapshot.pools
                                         if p.worker.startswith("decode")) > 0
    assert prefill["idle cached pages"] == sum(p.cached_idle for p in snapshot.pools
                                               if p.worker.startswith("prefill"))
    assert shown[0]["tenants"] == [["default", 8, 4, 50, 0]]
    assert dataclasses.asdict(snapshot.prefix_tenants["default"]) == {
        "prompt_pages": 8, "hit_pages": 4, "prefill_prompt_pages": 8, "prefill_hit_pages": 4,
        "shared_guard_trips": 0}
    assert (shown[0]["shared"], shown[0]["sharedText"]) == ({}, "none")
    # A shared-page trip and 51 tenants (one more than the table's rows), drawn in the turn
    # they are read back, in the state's own JSON form.
    tenants = {f"tenant-{i:012x}": {"prompt_pages": i, "hit_pages": i // 2,
                                    "prefill_prompt_pages": 0, "prefill_hit_pages": 0,
                                    "shared_guard_trips": i % 3} for i in range(1, 51)}
    state |= {"prefix_shared_guard_trips": {"checksum": 2},
              "prefix_tenants": state["prefix_tenants"] | tenants}
    more = json.loads(browser.evaluate(f"draw({json.dumps(state)}), {PREFIX_VIEW}"))
    assert more["shared"] == {"checksum": 2}
    assert len(more["tenants"]) == 50 and more["tenants"][:2] == [
        ["tenant-000000000032", 50, 25, 50, 2], ["tenant-000000000031", 49, 24, 49, 1]]
    assert more["tenants"][42:44] == [["default", 8, 4, 50, 0],  # ties: by name
                                       ["tenant-000000000008", 8, 4, 50, 2]]
    assert more["tenants"][-1] == ["tenant-000000000002", 2, 1, 50, 2]  # tenant-1 not shown
    assert more["tenantsMore"] == "tenants not shown: 1 (/metrics has every tenant)"
