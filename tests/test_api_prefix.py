"""Decode's prefix cache behind the API (issue 28): the salt of a request is its tenant's
(the API key's) and its cache_salt (api/serve/generation.py `salt_for`), judged from the
decode pool itself: which cached pages exist under which salt. OpenAI's client sends
cache_salt through extra_body and reads usage.prompt_tokens_details.cached_tokens, whole
and streamed; `kvproof serve --prefix-cache/--no-prefix-cache` reaches the engine's config.
"""

from __future__ import annotations

import argparse

import httpx
import openai
import pytest

from api.serve.app import create_app
from api.serve.auth import ApiKeys, tenant_of
from api.serve.generation import salt_for
from engine.prefix import page_digest
from engine.service import GUARDS
from spec import core
from tests.api_cases import LiveServer, protocol_engine, tiny_chat_model, wait_settled  # noqa: F401

KEYS = ["sk-alpha-1", "sk-beta-2"]
PAGE = 16  # the engine's default page_tokens
# A character-level tokenizer: 70 characters are 4 full pages and a partial one.
PROMPT = "You are a careful assistant. Answer in one short sentence, then stop: "
assert len(PROMPT) == 70


def serve(loaded, bugs=frozenset(), across_keys: bool = False):
    engine = protocol_engine(loaded, prefix_cache=True, bugs=bugs)
    return engine, LiveServer(create_app(engine, api_keys=ApiKeys.of(KEYS),
                                         share_prefix_cache_across_keys=across_keys))


def complete(server, key: str, cache_salt: str | None = None, prompt: str = PROMPT) -> int:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)
    extra = {"cache_salt": cache_salt} if cache_salt else {}
    reply = client.completions.create(model="default", prompt=prompt, max_tokens=3,
                                      temperature=0, extra_body=extra)
    assert reply.usage.prompt_tokens == len(prompt)
    return reply.usage.prompt_tokens_details.cached_tokens


def first_page_salts(engine) -> list[int]:
    """The salts under which decode holds PROMPT's first page cached, one per page."""
    wait_settled(engine)
    first = page_digest(engine.inner.tokenizer.encode(PROMPT)[:PAGE])
    pool = engine.inner.runtime.store.decode_pools[0]
    return sorted(page[core.IDENT][0] for page in pool
                  if page[core.IDENT] and page[core.IDENT][1] == (first,))


def metric_values(text: str, prefix: str) -> dict:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix) and "_created" not in line}


def tenant_figures(name: str, first: int, second: int) -> dict:
    """A per-tenant series of each key's tenant (the key itself never a label)."""
    return {f'{name}{{tenant="{tenant_of(key)}"}}': float(count)
            for key, count in zip(KEYS, (first, second))}


def guard_trips(name: str, trips: dict) -> dict:
    """A series by guard: every guard, those that never tripped at 0."""
    return {f'{name}{{guard="{guard}"}}': float(trips.get(guard, 0)) for guard in GUARDS}


def test_two_keys_never_share_a_page_and_one_key_does(tiny_chat_model):  # noqa: F811
    engine, live = serve(tiny_chat_model)
    with live as server:
        assert complete(server, KEYS[0]) == 0
        assert complete(server, KEYS[1]) == 0  # the same prompt, another tenant: no hit
        assert complete(server, KEYS[0]) == 4 * PAGE  # its own tenant's 4 full pages
        assert complete(server, KEYS[0], cache_salt="team-a") == 0  # another salt
        assert complete(server, KEYS[0], cache_salt="team-a") == 4 * PAGE
        salts = first_page_salts(engine)
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        state = httpx.get(server.url + "/v1/kvproof/state", timeout=10).json()
    # 5 requests of 4 full pages looked up, 2 x 4 hit; each request's fifth page (the
    # prompt's last 6 tokens and its output: a nonce) evicted at its release, as no prompt
    # can hit it; 4 pages for each of 3 salts stay cached.
    assert metric_values(metrics, "kvproof_prefix_cache") == {
        'kvproof_prefix_cache_pages{state="cached",worker="decode-0"}': 12.0,
        'kvproof_prefix_cache_pages{state="idle",worker="decode-0"}': 12.0,
        "kvproof_prefix_cache_prompt_pages_total": 20.0,
        "kvproof_prefix_cache_hit_pages_total": 8.0,
        "kvproof_prefix_cache_hit_ratio": 0.4,
        'kvproof_prefix_cache_evicted_pages_total{reason="lru"}': 0.0,
        'kvproof_prefix_cache_evicted_pages_total{reason="unshareable"}': 5.0,
        **guard_trips("kvproof_prefix_cache_shared_guard_trips_total", {}),
        # Per tenant: the first key's 4 requests hit twice, the second key's one never; the
        # cache_salt is no label. No guard tripped.
        **tenant_figures("kvproof_prefix_cache_tenant_prompt_pages_total", 16, 4),
        **tenant_figures("kvproof_prefix_cache_tenant_hit_pages_total", 8, 0),
        **tenant_figures("kvproof_prefix_cache_tenant_shared_guard_trips_total", 0, 0)}
    assert state["prefix_tenants"] == {  # the dashboard's, the same figures
        tenant_of(KEYS[0]): {"prompt_pages": 16, "hit_pages": 8, "prefill_prompt_pages": 16,
                             "prefill_hit_pages": 8, "shared_guard_trips": 0},
        tenant_of(KEYS[1]): {"prompt_pages": 4, "hit_pages": 0, "prefill_prompt_pages": 4,
                             "prefill_hit_pages": 0, "shared_guard_trips": 0}}
    assert state["prefix_shared_guard_trips"] == {}
    assert not any(secret in metrics for secret in (*KEYS, "team-a"))
    expected = [salt_for(tenant_of(KEYS[0]), None, False),
                salt_for(tenant_of(KEYS[1]), None, False),
                salt_for(tenant_of(KEYS[0]), "team-a", False)]
    assert salts == sorted(expected) and len(set(salts)) == 3  # one page per salt
    assert engine.inner.runtime.store.violation_total == 0
    # --prefix-cache is the prefill's cache too: the 2 hits computed 6 prompt tokens each;
    # its books are decode's (the fifth page evicted at each request's SendDone).
    assert metric_values(metrics, "kvproof_prefill_") == {
        'kvproof_prefill_cache_pages{state="cached",worker="prefill-0"}': 12.0,
        'kvproof_prefill_cache_pages{state="idle",worker="prefill-0"}': 12.0,
        "kvproof_prefill_cache_prompt_pages_total": 20.0,
        "kvproof_prefill_cache_hit_pages_total": 8.0,
        "kvproof_prefill_cache_hit_ratio": 0.4,
        'kvproof_prefill_cache_evicted_pages_total{reason="lru"}': 0.0,
        'kvproof_prefill_cache_evicted_pages_total{reason="unshareable"}': 5.0,
        "kvproof_prefill_computed_tokens_total": 5 * 70 - 2 * 4 * PAGE,
        **tenant_figures("kvproof_prefill_cache_tenant_prompt_pages_total", 16, 4),
        **tenant_figures("kvproof_prefill_cache_tenant_hit_pages_total", 8, 0)}


def test_with_the_no_salt_switch_the_page_tags_refuse_the_second_keys_read(
        tiny_chat_model):  # noqa: F811
    """NoSalt: the second key's request hits the first key's pages, and the identity in their
    tags (the first tenant's) fails its read: a clear 500 for that request alone, while the
    first key's requests before and after it finish."""
    engine, live = serve(tiny_chat_model, bugs={"NoSalt"})
    with live as server:
        assert complete(server, KEYS[0]) == 0
        with pytest.raises(openai.InternalServerError) as refused:
            complete(server, KEYS[1])
        assert complete(server, KEYS[0]) == 4 * PAGE
        salts = first_page_salts(engine)
    assert refused.value.code == "guard_tag" and "[outcome ErrTag]" in str(refused.value)
    assert salts == [0]  # NoSalt files every page under salt 0: one page for both
    runtime = engine.inner.runtime
    assert runtime.counts["prefix"]["hit_pages"] == 8  # the refused read hit them too
    # The store's oracles: tenants shared pages (the bug), but nobody read another's KV.
    assert "Isolation" not in runtime.store.violation_counts


def test_no_salt_with_tags_without_identity_lets_the_second_key_read_the_first_keys_pages(
        tiny_chat_model):  # noqa: F811
    engine, live = serve(tiny_chat_model, bugs={"NoSalt", "NoIdentTag"})
    with live as server:
        assert complete(server, KEYS[0]) == 0
        assert complete(server, KEYS[1]) == 4 * PAGE  # the bug: another tenant's pages
        salts = first_page_salts(engine)
    assert salts == [0]  # NoSalt files every page under salt 0: one page for both
    store = engine.inner.runtime.store
    # The store's oracles see it: the second tenant read KV of another salt and got Ok.
    assert store.violation_counts == {"Isolation": 1, "OkIsClean": 1}


def test_a_guard_trip_of_a_request_that_read_cached_pages_is_counted_as_shared(
        tiny_chat_model):  # noqa: F811
    """StaleHitLength: decode counts one cached page more than it holds (here the first
    key's first page, with nothing cached), reserves a fresh page for it that nobody writes,
    and the prefill skips it; the tag guard fails the request on its read. A guard trip of
    a request that read (it believes) shared pages: counted as shared, for its tenant."""
    engine, live = serve(tiny_chat_model, bugs={"StaleHitLength"})
    with live as server:
        with pytest.raises(openai.InternalServerError):
            complete(server, KEYS[0])
        wait_settled(engine)
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        state = httpx.get(server.url + "/v1/kvproof/state", timeout=10).json()
    assert metric_values(metrics, "kvproof_guard_trips") == guard_trips(
        "kvproof_guard_trips_total", {"tag": 1})
    assert metric_values(metrics, "kvproof_prefix_cache_shared") == guard_trips(
        "kvproof_prefix_cache_shared_guard_trips_total", {"tag": 1})
    assert metric_values(metrics, "kvproof_prefix_cache_tenant_") == {
        f'kvproof_prefix_cache_tenant_{figure}_total{{tenant="{tenant_of(KEYS[0])}"}}': count
        for figure, count in (("prompt_pages", 4.0), ("hit_pages", 1.0),
                              ("shared_guard_trips", 1.0))}
    assert state["prefix_shared_guard_trips"] == {"tag": 1}


def test_sharing_across_keys_drops_the_tenant_but_keeps_the_cache_salt(
        tiny_chat_model):  # noqa: F811
    engine, live = serve(tiny_chat_model, across_keys=True)
    with live as server:
        assert complete(server, KEYS[0]) == 0
        assert complete(server, KEYS[1]) == 4 * PAGE
        assert complete(server, KEYS[1], cache_salt="private") == 0
        salts = first_page_salts(engine)
    assert salts == sorted([salt_for(None, None, True), salt_for(None, "private", True)])


def test_cached_tokens_in_chat_and_in_the_streamed_usage(tiny_chat_model):  # noqa: F811
    engine, live = serve(tiny_chat_model)
    with live as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[0], max_retries=0,
                               timeout=60)
        messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "Hi"}]
        first = client.chat.completions.create(model="default", messages=messages,
                                               max_tokens=2, temperature=0)
        prompt_tokens = first.usage.prompt_tokens
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        chunks = list(client.chat.completions.create(
            model="default", messages=messages, max_tokens=2, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage.prompt_tokens == prompt_tokens
        assert usage.prompt_tokens_details.cached_tokens == prompt_tokens // PAGE * PAGE > 0


def test_serves_prefix_cache_flags_reach_the_engine_config():
    from api.serve.command import Refusal, _check, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flags, expected in ([], False), (["--prefix-cache"], True), (
            ["--no-prefix-cache"], False):
        _factory, config, _threads = _check(parser.parse_args(flags + ["--threads", "1"]))
        assert config.prefix_cache is expected, flags
    with pytest.raises(Refusal, match="--prefix-cache: not supported yet"):
        _check(parser.parse_args(["--processes", "--prefix-cache", "--threads", "1"]))
    args = parser.parse_args(["--share-prefix-cache-across-keys"])
    assert args.share_prefix_cache_across_keys is True


def test_n_completions_share_the_prompts_pages_as_siblings(tiny_chat_model):  # noqa: F811
    """A body with n = 3 makes its choices siblings (GenerationRequest.sibling_group): the
    first transfers the prompt, the other two wait for it and hit its 4 full pages, so the
    usage reports them cached (each prompt counted once) and decode holds them once."""
    engine, live = serve(tiny_chat_model)
    with live as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS[0], max_retries=0,
                               timeout=60)
        reply = client.completions.create(model="default", prompt=PROMPT, max_tokens=3, n=3,
                                          temperature=0)
        assert len(reply.choices) == 3
        assert reply.usage.prompt_tokens_details.cached_tokens == 4 * PAGE
        assert len({c.text for c in reply.choices}) == 1  # greedy: the same for each
        assert first_page_salts(engine) == [salt_for(tenant_of(KEYS[0]), None, False)]
