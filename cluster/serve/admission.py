"""What a replica lets in: which callers (the Host guard), how many at once (the queue bound), and
for how long (the time budget). Each answers a refusal in OpenAI's error shape.

* Host: a server without an API key answers only requests whose Host header names it (loopback,
  the configured ``api_host``, ``serve_allow_hosts`` / ``--allow-host``) on its port, and whose Origin,
  when a browser sends one, is that same whole origin. A web page on another site
  whose name its owner resolves to 127.0.0.1 (DNS rebinding) sends that name as Host, so it cannot
  use the model. With a key, the key is the guard and any name may carry it (a proxy, a tunnel).
  The names are the web UI's rule (cluster/webui/guard.py), imported, not copied.
* Queue: on the transformers engine every admitted request holds a thread and, once it has had a
  turn, its KV cache until it ends. ``serve_max_waiting`` requests may wait behind the generating
  one; the next is answered 429 with Retry-After at once, rather than queueing without end.
* Time: the budget counts from the request's arrival, so time spent waiting for the engine is part
  of it; a request still unanswered at the end of it is stopped with a 408, waiting or generating.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Optional

from cluster.webui.guard import allowed_hosts, listening, refused_host

from . import protocol as p

__all__ = ["Admission", "TimeBudget", "allowed_hosts", "check_host"]


def check_host(request, hosts: frozenset[str]) -> None:
    """A 403 unless the request's Host (and a browser's Origin) is this server's: a name of ``hosts``
    (``allowed_hosts``) on the port and scheme the request came in on, as the web UI checks them."""
    refusal = refused_host(request.headers, hosts, *listening(request.scope))
    if refusal:
        raise p.APIError(403, f"{refusal} (serve_allow_hosts in a config.) Without an API key this is what keeps "
                              "web pages from using the model; with one (API_KEY, or api_key in the config), any name may carry it.",
                         type="permission_error", code="host_not_allowed")


class Admission:
    """At most ``max_waiting`` requests waiting behind the one generating (None: no bound).

    ``with admission.admit():`` around a request's generation, or ``slot = admission.admit()`` and
    ``slot.release()`` when its stream ends. A refusal's Retry-After is the recent time a request
    stayed (a moving average), when a place is likely to free up."""

    def __init__(self, max_waiting: Optional[int]):
        self.max_waiting = max_waiting
        self.held = 0
        self.typical_s = 1.0

    def admit(self) -> "Slot":
        if self.max_waiting is not None and self.held > self.max_waiting:
            retry = min(60, max(1, math.ceil(self.typical_s)))
            raise p.APIError(429, f"this server is busy: one request is generating and {self.held - 1} wait for the "
                                  f"model (serve_max_waiting: {self.max_waiting}); retry in {retry} s.",
                             type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(retry)})
        self.held += 1
        return Slot(self)


class Slot:
    """One admitted request's place. ``release`` is idempotent, and runs when the slot is dropped:
    a stream that is never iterated (its client left before the first byte) frees its place too."""

    def __init__(self, admission: Admission):
        self._admission, self._since = admission, time.monotonic()

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission.held -= 1
            admission.typical_s = 0.8 * admission.typical_s + 0.2 * (time.monotonic() - self._since)

    def __enter__(self) -> "Slot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()


class TimeBudget:
    """Made when a request arrives; ``async with budget:`` (in that task or a later one, such as a
    stream's) cancels the enclosed awaits at arrival + ``seconds`` and raises TimeoutError. The work
    stays in the caller's task, so a client that goes away cancels it all. (asyncio.timeout_at,
    which Python 3.10 lacks.)"""

    def __init__(self, seconds: float):
        self.seconds, self.expired, self._handle, self._task = seconds, False, None, None
        self._deadline = asyncio.get_running_loop().time() + seconds

    async def __aenter__(self) -> "TimeBudget":
        self._task = asyncio.current_task()
        self._handle = asyncio.get_running_loop().call_at(self._deadline, self._expire)
        return self

    def _expire(self) -> None:
        self.expired = True
        self._task.cancel()

    async def __aexit__(self, kind, exc, tb) -> bool:
        self._handle.cancel()
        if kind is asyncio.CancelledError and self.expired:
            if hasattr(self._task, "uncancel"):
                self._task.uncancel()
            raise TimeoutError from None
        return False
