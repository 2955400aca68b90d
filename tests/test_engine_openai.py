"""The OpenAI-compatible HTTP engine against a real server on 127.0.0.1 serving the tiny target."""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from draftflow.chat import ChatFormat
from draftflow.config import OpenAIEngineConfig
from draftflow.engines.base import GenRequest, SamplingParams
from draftflow.engines.hf import HFEngine
from draftflow.engines.openai import EngineRequestError, EngineUnreachable, OpenAIEngine
from draftflow.errors import ConfigError
from tests.conftest import CONVERSATIONS, TOOLS
from tests.openai_server import OpenAITestServer

PARAMS = SamplingParams(max_new_tokens=6)


@pytest.fixture(scope="module")
def hf(tiny_target):
    return HFEngine.load(tiny_target.path, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def requests_(hf):
    chat = ChatFormat(hf.tokenizer)
    return [GenRequest(m, kw, chat.prompt_ids(m, **kw)) for m, kw in CONVERSATIONS]


@pytest.fixture(scope="module")
def expected(hf, requests_):
    """The transformers engine's own greedy answers, one request at a time (as the server runs them)."""
    return [hf.generate([r], PARAMS)[0] for r in requests_]


@pytest.fixture
def servers(hf):
    """Two fresh servers per test: a request an earlier test left behind (a held or timed-out one)
    can never be counted by this one. Stopping releases any request still held."""
    pair = [OpenAITestServer(hf).start(), OpenAITestServer(hf).start()]
    yield pair
    for s in pair:
        s.stop()


@pytest.fixture
def server(servers):
    """The first of this test's servers."""
    return servers[0]


@pytest.fixture
def make_engine():
    engines = []

    def make(*urls: str, **cfg) -> OpenAIEngine:
        cfg = {"timeout_s": 5.0, "max_retries": 4, **cfg}
        engines.append(OpenAIEngine(OpenAIEngineConfig(endpoints=list(urls), **cfg), "tiny", backoff_s=0.02))
        return engines[-1]

    yield make
    for e in engines:
        e.close()


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def assert_same(got, want):
    assert [c.text for c in got] == [c.text for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert [c.prompt_tokens for c in got] == [c.prompt_tokens for c in want]
    assert [c.completion_tokens for c in got] == [c.completion_tokens for c in want]


def test_greedy_text_equals_transformers_engine(server, make_engine, requests_, expected):
    got = make_engine(server.url).generate(requests_, PARAMS)
    assert_same(got, expected)
    assert all(c.ids is None and c.tool_calls is None for c in got)
    (body,) = [b for b in server.bodies if "tools" in b]  # tools in the OpenAI field, arguments as JSON text
    assert body["tools"] == TOOLS and body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert body["max_tokens"] == 6 and body["temperature"] == 0.0 and "top_k" not in body


def test_template_kwargs_reach_the_template(server, make_engine, hf):
    chat, msgs = ChatFormat(hf.tokenizer), [{"role": "user", "content": "Hello there"}]
    reqs = [GenRequest(msgs, {"enable_thinking": flag}) for flag in (False, True)]
    off, on = make_engine(server.url).generate(reqs, PARAMS)
    assert off.prompt_tokens == len(chat.prompt_ids(msgs, enable_thinking=False))
    assert on.prompt_tokens == len(chat.prompt_ids(msgs, enable_thinking=True))
    assert off.prompt_tokens != on.prompt_tokens


def test_retries_survive_5xx_and_a_timeout(server, make_engine, requests_, expected):
    server.fail_next(500)
    server.fail_next(503, n=2)
    server.hold_next()  # no answer until the test ends: a timeout however loaded the machine is
    engine = make_engine(server.url, timeout_s=2.0, max_retries=5, max_concurrency=1)
    assert_same(engine.generate(requests_, PARAMS), expected)
    assert len(server.bodies) == len(requests_) + 4


def test_round_robin_spreads_requests_and_skips_a_dead_endpoint(servers, server, make_engine, requests_, expected):
    a, b = servers
    assert_same(make_engine(a.url, b.url).generate(requests_ * 2, PARAMS), expected * 2)
    assert a.handled == b.handled == len(requests_)
    engine = make_engine(dead_url(), b.url, max_retries=1)
    assert_same(engine.generate(requests_, PARAMS), expected)


def test_server_restart_mid_batch_loses_nothing(server, make_engine, requests_, expected):
    engine = make_engine(server.url, max_concurrency=2, max_retries=8)
    restart = server.restart_when_held(down_s=0.3)  # the first request is in flight when the server dies
    assert_same(engine.generate(requests_ * 2, PARAMS), expected * 2)
    restart.join()
    assert server.dropped >= 1


def test_client_error_is_not_retried_and_names_the_url(server, make_engine, requests_):
    server.fail_next(400, message="max_tokens is too large:\n 4096 > 2048")
    engine = make_engine(server.url, max_retries=4, max_concurrency=1)
    with pytest.raises(EngineRequestError, match="max_tokens is too large") as err:
        engine.generate(requests_[:2], PARAMS)
    msg = str(err.value)
    assert f"{server.url}/chat/completions answered 400" in msg and "\n" not in msg
    assert err.value.status == 400 and err.value.index == 0 and server.bodies.count(server.bodies[0]) == 1


def test_retries_exhausted_raise_a_draftflow_error(server, make_engine, requests_):
    server.fail_next(502, n=3)
    with pytest.raises(EngineRequestError, match="gave up after 3 attempts"):
        make_engine(server.url, max_retries=2).generate(requests_[:1], PARAMS)


def test_check_reachable(server, make_engine):
    make_engine(server.url).check_reachable()
    url = dead_url()
    with pytest.raises(EngineUnreachable, match=f"cannot reach {url}/models"):
        make_engine(server.url, url).check_reachable()
    with pytest.raises(ConfigError, match="set regenerate.openai.model"):
        OpenAIEngine(OpenAIEngineConfig(endpoints=[server.url]), "other-model").check_reachable()


def test_concurrency_never_exceeds_the_bound(server, make_engine, requests_):
    server.gate_first(3)  # the first requests wait until three are in flight: the bound is reached, not raced
    make_engine(server.url, max_concurrency=3).generate(requests_ * 3, PARAMS)
    assert server.peak == 3


def test_reasoning_and_tool_calls_are_mapped(server, make_engine, requests_):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    server.canned_next({"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": [call]},
                       finish_reason="tool_calls")
    (c,) = make_engine(server.url, max_concurrency=1).generate(requests_[:1], PARAMS)
    assert (c.text, c.reasoning, c.finish_reason) == ("", "think", "stop")
    assert c.tool_calls == [{"type": "function", "id": "c1",
                             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]


def test_generate_from_a_running_loop_and_worker_threads(server, make_engine, requests_, expected, monkeypatch):
    monkeypatch.setenv("DRAFTFLOW_TEST_KEY", "sk-test")
    engine = make_engine(server.url, api_key_env="DRAFTFLOW_TEST_KEY")

    async def inside_a_loop():
        return engine.generate(requests_[:2], PARAMS)

    assert_same(asyncio.run(inside_a_loop()), expected[:2])
    with ThreadPoolExecutor(2) as pool:
        got = [c for batch in pool.map(lambda r: engine.generate([r], PARAMS), requests_) for c in batch]
    assert_same(got, expected)
    assert set(server.auth) == {"Bearer sk-test"}
