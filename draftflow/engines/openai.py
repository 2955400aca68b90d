"""OpenAI-compatible chat endpoints (`vllm serve`, SGLang, any) as a generation engine.

`OpenAIEngine.generate` posts one `/chat/completions` request per conversation,
spread round-robin over the configured endpoints, with at most `max_concurrency`
requests in flight across all of them. Transient failures (5xx, 408, 429,
timeouts, dropped connections) are retried with exponential backoff and jitter,
each retry on the next endpoint, so a dead server is skipped; any other 4xx is
the caller's fault and raises `EngineRequestError` at once, naming the URL and
the server's own message.

What it does not know: token ids. A chat endpoint returns text, so completions
have `ids=None` and the tokenize stage derives ids from the template. The server
renders the prompt with *its* chat template; `chat_template_kwargs` (e.g.
`enable_thinking`) are passed through, and `tools` go in the OpenAI `tools` field.

Tool calls that the server parsed (`message.tool_calls`) are returned in the
in-memory conversation shape (`{"type": "function", "function": {"name",
"arguments": dict}}`, plus `id` when sent) as an extra attribute on each
`Completion`: read them with `getattr(completion, "tool_calls", None)` (None when
the server returned none). A server without a tool parser leaves the calls in
`text` (`<tool_call>…</tool_call>`) for the caller to parse.

Key trade-off: the async client runs on a private event loop in a daemon thread,
started on first use and stopped by `close()`. `generate` stays synchronous and
works from any thread (with or without a running loop), and the concurrency
bound and connection pool are shared by every caller of one engine (shard tasks
on a thread pool), at the cost of one extra thread per open engine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import random
import threading
from typing import Any

import httpx

from draftflow.config import OpenAIEngineConfig
from draftflow.engines.base import Completion, GenRequest, SamplingParams
from draftflow.errors import ConfigError, DraftflowError

log = logging.getLogger(__name__)

RETRY_STATUS = {408, 429}  # plus every 5xx
FINISH = {"stop": "stop", "length": "length", "tool_calls": "stop", "function_call": "stop", "eos": "stop"}
BACKOFF_CAP_S = 30.0
REACH_TIMEOUT_S = 5.0


class EngineUnreachable(DraftflowError):
    """An endpoint cannot be reached (or refuses the listing) when the stage starts."""


class EngineRequestError(DraftflowError):
    """A request failed for good: a non-retryable 4xx, a malformed answer, or retries exhausted.

    `url` is the endpoint URL, `status` the HTTP status (None for transport errors) and
    `index` the position of the failed request in the batch given to `generate`.
    """

    def __init__(self, message: str, url: str, status: int | None = None):
        super().__init__(message)
        self.url, self.status, self.index = url, status, None


class _Transient(Exception):
    """A failure worth retrying; `retry_after` is the server's hint in seconds, if any."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _server_message(resp: httpx.Response) -> str:
    """The error text an OpenAI-compatible server put in its body (`error.message`, `detail`, ...)."""
    try:
        body = resp.json()
    except ValueError:
        return _one_line(resp.text or resp.reason_phrase)
    if isinstance(body, dict):
        err = body.get("error", body)
        msg = err.get("message") if isinstance(err, dict) else err
        return _one_line(msg or body.get("detail") or body.get("message") or body)
    return _one_line(body)


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return float(resp.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def _wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI wire form: tool-call arguments as JSON text (in memory they are dicts)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function", {}))
                if not isinstance(fn.get("arguments", ""), str):
                    fn["arguments"] = json.dumps(fn["arguments"], ensure_ascii=False)
                calls.append({**c, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _wire_tools(tools: Any) -> list[dict[str, Any]]:
    """The OpenAI `tools` field: bare function schemas get the `{"type": "function"}` wrapper."""
    if isinstance(tools, str):
        tools = json.loads(tools)
    return [t if "type" in t else {"type": "function", "function": t} for t in tools]


def _parse_calls(calls: Any) -> list[dict[str, Any]] | None:
    """Server tool calls -> in-memory shape (arguments parsed to a dict when they are JSON)."""
    if not calls:
        return None
    out = []
    for c in calls:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass  # keep the text: the caller compares and reports it as generated
        call = {"type": "function", "function": {"name": fn.get("name"), "arguments": args}}
        if c.get("id"):
            call["id"] = c["id"]
        out.append(call)
    return out


def request_body(req: GenRequest, params: SamplingParams, model: str) -> dict[str, Any]:
    """The JSON body of one chat-completion request."""
    kwargs = dict(req.template_kwargs)
    tools = kwargs.pop("tools", None)
    body: dict[str, Any] = {
        "model": model, "messages": _wire_messages(req.messages), "max_tokens": params.max_new_tokens,
        "temperature": params.temperature, "top_p": params.top_p, "seed": params.seed,
    }
    if params.top_k > 0:  # 0 = disabled, as in SamplingParams; vLLM/SGLang take it as an extra field
        body["top_k"] = params.top_k
    if tools:
        body["tools"] = _wire_tools(tools)
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return body


def to_completion(data: Any, req: GenRequest, url: str) -> Completion:
    """Map a chat-completion answer to a `Completion` (text-only; tool calls as an attribute)."""
    try:
        choice = data["choices"][0]
        msg = choice["message"]
    except (KeyError, IndexError, TypeError) as exc:
        raise EngineRequestError(f"{url} answered without choices[0].message: {_one_line(data)}", url) from exc
    if choice.get("finish_reason") == "abort":
        raise _Transient("the server aborted the request")
    reason = FINISH.get(choice.get("finish_reason"))
    if reason is None:
        raise EngineRequestError(f"{url} answered finish_reason={choice.get('finish_reason')!r}; "
                                 f"expected one of {sorted(FINISH)}", url)
    usage = data.get("usage") or {}
    completion = Completion(
        ids=None, text=msg.get("content") or "", finish_reason=reason,
        prompt_tokens=int(usage.get("prompt_tokens") or len(req.prompt_ids)),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        reasoning=msg.get("reasoning_content") or msg.get("reasoning") or None,
    )
    completion.tool_calls = _parse_calls(msg.get("tool_calls"))  # see the module docstring
    return completion


class _LoopThread:
    """A private event loop on a daemon thread, so sync callers on any thread can run coroutines."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="draftflow-openai", daemon=True)
        self.thread.start()

    def run(self, coro):
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt in the caller: stop the batch too
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class OpenAIEngine:
    """Chat completions from OpenAI-compatible endpoints.

    Args:
        cfg: endpoints, served model, key variable, concurrency, timeout, retries.
        model: the served model name sent in every request.
        backoff_s: the first retry's delay; each retry doubles it (capped at 30 s), times a jitter in [0.5, 1.5).

    Raises:
        ConfigError: no endpoints are configured.
    """

    name = "openai"

    def __init__(self, cfg: OpenAIEngineConfig, model: str, backoff_s: float = 0.5):
        if not cfg.endpoints:
            raise ConfigError("regenerate.openai.endpoints is empty; give base URLs such as http://host:8000/v1")
        self.cfg, self.model_id, self.backoff_s = cfg, model, backoff_s
        self.endpoints = [e.rstrip("/") for e in cfg.endpoints]
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._rr = itertools.count()
        self._runner: _LoopThread | None = None
        self._client: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None
        self._lock = threading.Lock()

    def generate(self, requests: list[GenRequest], params: SamplingParams) -> list[Completion]:
        """One completion per request, in order; blocks until all are done.

        Raises:
            EngineRequestError: a request was refused (non-retryable 4xx, malformed answer) or
                still failed after `max_retries` retries; the other requests are cancelled.
        """
        if not requests:
            return []
        return self._loop().run(self._batch(requests, params))

    def close(self) -> None:
        """Close the connections and stop the private loop (a later `generate` starts a new one)."""
        with self._lock:
            runner, self._runner = self._runner, None
        if runner is None or runner.pid != os.getpid():
            return
        if self._client is not None:
            runner.run(self._client.aclose())
        self._client = self._sem = None
        runner.stop()

    def check_reachable(self) -> None:
        """GET `<endpoint>/models` on every endpoint; fail fast, naming the URL.

        Raises:
            EngineUnreachable: an endpoint cannot be reached or answers with an error.
            ConfigError: an endpoint lists its models and `model_id` is not among them.
        """
        with httpx.Client(timeout=REACH_TIMEOUT_S, headers=self._headers) as client:
            for endpoint in self.endpoints:
                self._check_one(client, f"{endpoint}/models")

    def _check_one(self, client: httpx.Client, url: str) -> None:
        try:
            resp = client.get(url)
        except httpx.HTTPError as exc:
            raise EngineUnreachable(f"cannot reach {url} ({type(exc).__name__}: {_one_line(exc)}); check "
                                    "regenerate.openai.endpoints and that the server is up") from None
        if resp.status_code >= 400:
            hint = f"; is ${self.cfg.api_key_env} set?" if resp.status_code in (401, 403) else ""
            raise EngineUnreachable(f"{url} answered {resp.status_code}: {_server_message(resp)}{hint}")
        try:
            served = [m["id"] for m in resp.json().get("data", [])]
        except (ValueError, AttributeError, KeyError, TypeError):
            return  # not a standard listing: the chat requests will tell
        if served and self.model_id not in served:
            raise ConfigError(f"{url} serves {served}, not {self.model_id!r}; set regenerate.openai.model")

    def _loop(self) -> _LoopThread:
        with self._lock:
            if self._runner is None or self._runner.pid != os.getpid():  # first use, or after a fork
                self._runner, self._client, self._sem = _LoopThread(), None, None
            return self._runner

    async def _batch(self, requests: list[GenRequest], params: SamplingParams) -> list[Completion]:
        if self._client is None:  # created on the private loop, which owns its connections
            limits = httpx.Limits(max_connections=self.cfg.max_concurrency,
                                  max_keepalive_connections=self.cfg.max_concurrency)
            self._client = httpx.AsyncClient(headers=self._headers, limits=limits,
                                             timeout=httpx.Timeout(self.cfg.timeout_s))
            self._sem = asyncio.Semaphore(self.cfg.max_concurrency)
        tasks = [asyncio.ensure_future(self._complete(i, r, params)) for i, r in enumerate(requests)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _complete(self, index: int, req: GenRequest, params: SamplingParams) -> Completion:
        try:
            return await self._attempts(req, params)
        except EngineRequestError as exc:
            exc.index = index
            raise

    async def _attempts(self, req: GenRequest, params: SamplingParams) -> Completion:
        """One request: round-robin start, then each retry on the next endpoint after a backoff."""
        body = request_body(req, params, self.model_id)
        start, attempts = next(self._rr), self.cfg.max_retries + 1
        for attempt in range(attempts):
            url = f"{self.endpoints[(start + attempt) % len(self.endpoints)]}/chat/completions"
            try:
                async with self._sem:
                    return to_completion(await self._post(url, body), req, url)
            except _Transient as exc:
                if attempt + 1 == attempts:
                    raise EngineRequestError(f"{url}: {exc} (gave up after {attempts} attempts; "
                                             "raise regenerate.openai.max_retries or timeout_s)", url) from None
                delay = self._backoff(attempt, exc.retry_after)
                log.warning("%s: %s; retry %d/%d in %.2fs", url, exc, attempt + 1, attempts - 1, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        delay = min(BACKOFF_CAP_S, self.backoff_s * 2**attempt) * random.uniform(0.5, 1.5)
        return max(delay, min(retry_after or 0.0, BACKOFF_CAP_S))

    async def _post(self, url: str, body: dict[str, Any]) -> Any:
        """POST once; transient failures raise `_Transient`, permanent ones `EngineRequestError`."""
        try:
            resp = await asyncio.wait_for(self._client.post(url, json=body), self.cfg.timeout_s)
        except (httpx.TimeoutException, asyncio.TimeoutError):
            raise _Transient(f"no answer within {self.cfg.timeout_s:g}s") from None
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise _Transient(f"{type(exc).__name__}: {_one_line(exc) or 'connection lost'}") from None
        if resp.status_code >= 500 or resp.status_code in RETRY_STATUS:
            raise _Transient(f"{resp.status_code}: {_server_message(resp)}", _retry_after(resp))
        if resp.status_code >= 400:
            raise EngineRequestError(f"{url} answered {resp.status_code}: {_server_message(resp)}",
                                     url, resp.status_code)
        try:
            return resp.json()
        except ValueError:
            raise EngineRequestError(f"{url} answered non-JSON: {_one_line(resp.text)}", url) from None
