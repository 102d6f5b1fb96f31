"""Rewards from outside the job: a reward server over HTTP, or an LLM judge.

``reward_model_type: api`` keeps LLaMA-Factory's meaning: ``reward_model`` is the URL of a reward
server. Two protocols, chosen by the URL:

* ours, for a URL ending in ``/v1/score`` (``rayfactory serve`` of a stage rm output)::

      POST {"model": <served name>, "conversations": [[{"role": "user", "content": prompt},
                                                       {"role": "assistant", "content": completion}], ...]}
      ->   {"scores": [float, ...]}            (the model name is read from GET /v1/models if not given)

* plain JSON, for any other URL (OpenRLHF's remote reward protocol, ``--remote_rm_url``)::

      POST {"query": [prompt + completion, ...], "prompts": [prompt, ...], "labels": [reference, ...]}
      ->   {"rewards": [float, ...]}           (one per query, in order)

``JudgeReward`` asks any OpenAI-compatible ``/v1/chat/completions`` endpoint (``rayfactory serve``
included) to grade each completion with a rubric and parses "Score: N" from the reply, scaled to
[0, 1]; a reply without a score gives None ("does not apply", as for reward functions).

``api_reward(url)`` is what ``reward_model_type: api`` calls from the PPO controller: a judge for a
URL ending in ``/chat/completions``, else a reward server (its protocol by the URL, as above).

Both are reward functions in rewards.py's convention (``fn(prompts, completions, reference, ...)``),
so a user module can hand one to ``reward_funcs`` today. Every attempt has a timeout (bounding the
whole reply, not only each read), failed attempts are retried with exponential backoff
(connection errors, timeouts, HTTP 429/5xx and unreadable replies; not other 4xx), batches go out
on a bounded thread pool, and when the attempts run out the error is one paragraph naming the URL.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from registries.errors import UserError

from stages.rl.config.checks import is_judge_url

Prompt = Union[str, list[dict[str, Any]]]  # a prompt's text, or its messages


class RemoteRewardError(UserError):
    """A reward server or judge that cannot be reached or answers something unusable."""


class _Retryable(Exception):
    """An attempt that failed in a way a later attempt may not (the message says how)."""


@dataclass(frozen=True)
class HTTPOptions:
    timeout: float = 30.0  # seconds for one whole attempt (connect, send, the full reply)
    retries: int = 3  # attempts after the first
    backoff: float = 0.5  # seconds before the first retry, doubled for each next one
    max_backoff: float = 8.0
    concurrency: int = 8  # requests in flight at once
    batch_size: int = 32  # completions per request to a reward server
    api_key: Optional[str] = None  # sent as "Authorization: Bearer <key>"


def post_json(url: str, payload: Any, options: HTTPOptions, method: str = "POST") -> Any:
    """The JSON reply to ``payload`` at ``url``, retried per ``options``; RemoteRewardError at the end."""
    attempts, start, wait = options.retries + 1, time.monotonic(), options.backoff
    for attempt in range(attempts):
        try:
            return _attempt(url, payload, options, method)
        except _Retryable as exc:
            if attempt + 1 == attempts:
                raise RemoteRewardError(
                    f"The reward endpoint {url} failed {attempts} time(s) over {time.monotonic() - start:.1f} s; the "
                    f"last attempt: {exc}. Check that the server is running and reachable from every node of the "
                    f"job (e.g. curl -X {method} {url}), or raise the timeout/retries if it is only slow.") from None
        time.sleep(min(wait, options.max_backoff))
        wait *= 2
    raise AssertionError("unreachable")


def _attempt(url: str, payload: Any, options: HTTPOptions, method: str) -> Any:
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if options.api_key:
        headers["Authorization"] = f"Bearer {options.api_key}"
    deadline = time.monotonic() + options.timeout
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=options.timeout) as response:
            body = _read_until(response, deadline)
    except urllib.error.HTTPError as exc:
        detail = exc.read(2000).decode(errors="replace")
        if exc.code == 429 or exc.code >= 500:
            raise _Retryable(f"HTTP {exc.code}: {detail[:300]}") from None
        raise RemoteRewardError(
            f"The reward endpoint {url} refused the request with HTTP {exc.code}: {detail[:500]}. Check the URL, "
            "the protocol it speaks (see docs/rl.md, 'Tools, sandbox and remote rewards') and the API key.") from None
    except (urllib.error.URLError, OSError) as exc:  # refused, reset, DNS, socket timeouts
        raise _Retryable(f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}") from None
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _Retryable(f"the reply is not JSON: {body[:200]!r}") from None


def _read_until(response, deadline: float) -> bytes:
    """The whole body, or a retryable timeout past ``deadline``: urllib's timeout bounds each read
    only, so a server that trickles bytes could otherwise hold an attempt open for ever. Checked
    between reads, an attempt ends within about two timeouts whatever the server does."""
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Retryable("timed out while reading the reply")
        chunk = response.read1(65536)  # what has arrived (read(n) would wait for all n bytes)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _numbers(values: Any, n: int, url: str, key: str) -> list[float]:
    if not isinstance(values, list) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, list) else repr(values)[:100]
        raise RemoteRewardError(f"The reward endpoint {url} answered {key}={got} for {n} completions; it must "
                                f"answer a list of {n} numbers, in order.")
    out = []
    for v in values:
        if isinstance(v, list) and len(v) == 1:  # a reward head's [score]
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise RemoteRewardError(f"The reward endpoint {url} answered {key} holding {v!r}; each must be a "
                                    "finite number.")
        out.append(float(v))
    return out


def _messages(prompt: Prompt) -> list[dict[str, Any]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def _text(prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)


def _api_base(url: str) -> str:
    """``http://host:8000/v1`` from any URL of an OpenAI-style server (root, /v1, or an endpoint)."""
    url = url.rstrip("/")
    i = url.find("/v1/")
    return url[:i + 3] if i != -1 else (url if url.endswith("/v1") else url + "/v1")


def served_model(url: str, options: HTTPOptions) -> str:
    """The first model an OpenAI-compatible server lists (``rayfactory serve``: the base model)."""
    models_url = _api_base(url) + "/models"
    reply = post_json(models_url, None, options, method="GET")
    try:
        return reply["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise RemoteRewardError(f"{models_url} lists no model ({str(reply)[:200]}); set the model name explicitly.")


class RemoteReward:
    """A reward server as a reward function; ``protocol`` "score" (ours) or "json" (OpenRLHF's),
    by default "score" for a URL ending in /v1/score and "json" otherwise."""

    def __init__(self, url: str, protocol: Optional[str] = None, model: Optional[str] = None,
                 options: HTTPOptions = HTTPOptions()):
        self.url, self.options, self.model = url, options, model
        self.protocol = protocol or ("score" if url.rstrip("/").endswith("/v1/score") else "json")
        if self.protocol not in ("score", "json"):
            raise RemoteRewardError(f"Unknown remote reward protocol {protocol!r} for {url}; use 'score' "
                                    "(rayfactory serve's /v1/score) or 'json' (query/prompts/labels -> rewards).")

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str],
                 reference: Optional[Sequence[str]] = None, **columns) -> list[float]:
        reference = list(reference) if reference is not None else [""] * len(completions)
        if self.protocol == "score" and self.model is None:
            self.model = served_model(self.url, self.options)
        size = max(1, self.options.batch_size)
        chunks = [(prompts[i:i + size], completions[i:i + size], reference[i:i + size])
                  for i in range(0, len(completions), size)]
        return [r for part in _pool_map(self._score_chunk, chunks, self.options.concurrency) for r in part]

    def _score_chunk(self, chunk) -> list[float]:
        prompts, completions, reference = chunk
        if self.protocol == "score":
            payload = {"model": self.model, "conversations": [
                _messages(p) + [{"role": "assistant", "content": c}] for p, c in zip(prompts, completions)]}
            key = "scores"
        else:
            texts = [_text(p) for p in prompts]
            payload = {"query": [p + c for p, c in zip(texts, completions)], "prompts": texts,
                       "labels": list(reference)}
            key = "rewards"
        reply = post_json(self.url, payload, self.options)
        if not isinstance(reply, dict) or key not in reply:
            raise RemoteRewardError(f"The reward endpoint {self.url} answered {str(reply)[:200]!r}, without "
                                    f"'{key}'; the {self.protocol!r} protocol answers {{\"{key}\": [numbers]}}.")
        return _numbers(reply[key], len(completions), self.url, key)


DEFAULT_RUBRIC = (
    "You are grading an answer to a question.\n\nQuestion:\n{prompt}\n\nReference answer (may be empty):\n"
    "{reference}\n\nAnswer to grade:\n{completion}\n\nHow correct and helpful is the answer, from 0 (wrong or "
    "useless) to 10 (fully correct)? Reply with one line, \"Score: N\", and nothing else.")
_SCORE = re.compile(r"score\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_BARE_NUMBER = re.compile(r"\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*\d+)?\s*\.?\s*")


def parse_score(reply: str, max_score: float = 10.0) -> Optional[float]:
    """The last "Score: N" in ``reply`` (or a reply that is only a number), scaled by ``max_score``
    to [0, 1] and clipped; None when the reply holds no score."""
    found = _SCORE.findall(reply)
    if not found:
        bare = _BARE_NUMBER.fullmatch(reply)
        found = [bare.group(1)] if bare else []
    if not found:
        return None
    return min(max(float(found[-1]) / max_score, 0.0), 1.0)


class JudgeReward:
    """An LLM judge as a reward function: one chat request per completion to ``url`` (an
    OpenAI-compatible server; root, /v1 or /v1/chat/completions), the rubric filled with
    ``{prompt}``, ``{completion}`` and ``{reference}`` (plain replacement: other braces stay)."""

    def __init__(self, url: str, model: Optional[str] = None, rubric: str = DEFAULT_RUBRIC, max_score: float = 10.0,
                 max_tokens: int = 64, options: HTTPOptions = HTTPOptions()):
        self.url = url if url.rstrip("/").endswith("/chat/completions") else _api_base(url) + "/chat/completions"
        self.model, self.rubric, self.max_score = model, rubric, max_score
        self.max_tokens, self.options = max_tokens, options

    def __call__(self, prompts: Sequence[Prompt], completions: Sequence[str],
                 reference: Optional[Sequence[str]] = None, **columns) -> list[Optional[float]]:
        reference = list(reference) if reference is not None else [""] * len(completions)
        if self.model is None:
            self.model = served_model(self.url, self.options)
        return _pool_map(self._judge, list(zip(prompts, completions, reference)), self.options.concurrency)

    def _judge(self, item) -> Optional[float]:
        prompt, completion, reference = item
        text = (self.rubric.replace("{prompt}", _text(prompt)).replace("{completion}", completion)
                .replace("{reference}", reference or ""))
        reply = post_json(self.url, {"model": self.model, "messages": [{"role": "user", "content": text}],
                                     "temperature": 0, "max_tokens": self.max_tokens}, self.options)
        try:
            content = reply["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise RemoteRewardError(f"The judge endpoint {self.url} answered {str(reply)[:200]!r}, not a chat "
                                    "completion (choices[0].message.content).") from None
        return parse_score(content, self.max_score)


def api_reward(url: str, options: HTTPOptions = HTTPOptions(), rubric: Optional[str] = None,
               model: Optional[str] = None, max_score: float = 10.0) -> Union[RemoteReward, JudgeReward]:
    """``reward_model_type: api``'s scorer for ``reward_model`` = ``url``: an LLM judge (``rubric``,
    default the built-in one; ``model``, default the first served) for an OpenAI-style
    ``.../chat/completions`` URL, else a reward server."""
    if is_judge_url(url):
        return JudgeReward(url, model=model, rubric=rubric or DEFAULT_RUBRIC, max_score=max_score, options=options)
    return RemoteReward(url, options=options)


def _pool_map(fn: Callable[[Any], Any], items: list, concurrency: int) -> list:
    """``fn`` over ``items`` with at most ``concurrency`` in flight, results in order; the first
    error is raised once every request has finished (each is bounded by its own timeout)."""
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(items)))) as pool:
        return list(pool.map(fn, items))
