"""The serve group of a config: where the endpoint listens, who may call it, how it scales.

Host, port and key follow LLaMA-Factory's ``api``: the ``API_HOST`` / ``API_PORT`` / ``API_KEY``
environment variables, then these keys, then 127.0.0.1:8000 with no key; ``--host`` / ``--port``
on the command line win over all of them (resolved once, in cluster/cli.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from registries.errors import ArgumentError


@dataclass
class ServeArguments:
    api_host: str = "127.0.0.1"  # loopback by default: nothing outside this machine can reach it
    api_port: int = 8000  # the HTTP port of the Serve proxy
    api_key: Optional[str] = None  # when set, every request needs "Authorization: Bearer <key>"
    # Without a key, the Host header must name this server: loopback, api_host, or one of these
    # (`--allow-host`), so a web page whose own name resolves to 127.0.0.1 (DNS rebinding) cannot use it.
    serve_allow_hosts: list[str] = field(default_factory=list)
    serve_num_replicas: int = 1  # copies of the model, each an actor with serve_replica_resources
    # Ray Serve autoscaling_config (min_replicas, max_replicas, target_ongoing_requests, ...);
    # when set it replaces serve_num_replicas.
    serve_autoscaling: Optional[dict[str, Any]] = None
    serve_max_ongoing_requests: int = 64  # per replica; more wait in Serve's queue
    # each replica's Ray resources
    serve_replica_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    # What one request may ask for: more is answered with a 4xx before any work starts.
    serve_max_request_bytes: int = 1 << 20  # the JSON body (1 MiB; the prompt-token cap is vllm_maxlen)
    serve_max_n: int = 16  # choices per request
    serve_max_stop: int = 16  # stop strings per request (OpenAI allows 4)
    serve_max_stop_length: int = 256  # characters in one stop string
    serve_request_timeout_s: float = 300  # a request not answered this long after it arrived is stopped (408)
    # The transformers engine (one model, requests take turns on it; vLLM batches them itself):
    serve_max_waiting: int = 16  # requests waiting behind the generating one; more get 429 + Retry-After
    serve_turn_s: float = 0.25  # how long one request generates while others wait before the next one's turn
    serve_docs: bool = False  # /docs and /openapi.json (their page loads scripts from a CDN)
    # Images (a vision model's image_url parts, base64 data URLs): each is also inside the request
    # body, so serve_max_request_bytes bounds them too; raise it for large pictures.
    serve_max_images: int = 8  # image parts per request
    serve_max_image_bytes: int = 8 << 20  # one image's decoded file (8 MiB)
    serve_max_image_pixels: int = 4096 * 4096  # one image's width x height, read from its header

    def request_limits(self) -> "RequestLimits":
        return RequestLimits(self.serve_max_request_bytes, self.serve_max_n, self.serve_max_stop,
                             self.serve_max_stop_length, self.serve_request_timeout_s, self.serve_max_images,
                             self.serve_max_image_bytes, self.serve_max_image_pixels, self.serve_max_waiting,
                             self.serve_turn_s)

    def __post_init__(self) -> None:
        if not 0 < self.api_port < 65536:
            raise ArgumentError("api_port", f"api_port must be a TCP port (1-65535), got {self.api_port}.")
        if self.serve_num_replicas < 1:
            raise ArgumentError("serve_num_replicas", f"serve_num_replicas must be at least 1, got {self.serve_num_replicas}.")
        for name in ("serve_max_request_bytes", "serve_max_n", "serve_max_stop", "serve_max_stop_length",
                     "serve_max_images", "serve_max_image_bytes", "serve_max_image_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ArgumentError(name, f"{name} must be a whole number of at least 1, got {value!r}.")
        if isinstance(self.serve_request_timeout_s, bool) or not isinstance(self.serve_request_timeout_s, (int, float)) \
                or not self.serve_request_timeout_s > 0:
            raise ArgumentError("serve_request_timeout_s", "serve_request_timeout_s is seconds, a number above 0, got "
                                                           f"{self.serve_request_timeout_s!r}.")
        if isinstance(self.serve_max_waiting, bool) or not isinstance(self.serve_max_waiting, int) \
                or self.serve_max_waiting < 0:
            raise ArgumentError("serve_max_waiting", "serve_max_waiting is how many requests may wait for the "
                                f"transformers engine, a whole number of at least 0, got {self.serve_max_waiting!r}.")
        if isinstance(self.serve_turn_s, bool) or not isinstance(self.serve_turn_s, (int, float)) \
                or not 0 <= self.serve_turn_s < self.serve_request_timeout_s:
            raise ArgumentError("serve_turn_s", "serve_turn_s is seconds one request generates before a waiting one "
                                "takes its turn: 0 (turns at every token) or more, and below serve_request_timeout_s "
                                f"({self.serve_request_timeout_s:g}), got {self.serve_turn_s!r}.")
        for name in self.serve_allow_hosts:
            if not name.strip() or "/" in name or name.strip().count(":") == 1:
                raise ArgumentError("serve_allow_hosts", f"serve_allow_hosts takes host names (api.example, "
                                    f"10.0.0.5), without a scheme or port; got {name!r}.")
        if self.serve_max_ongoing_requests < 1:
            raise ArgumentError(
                "serve_max_ongoing_requests",
                f"serve_max_ongoing_requests must be at least 1, got {self.serve_max_ongoing_requests}.",
            )


@dataclass(frozen=True)
class RequestLimits:
    """The slice of the serve keys a replica enforces on each request."""

    max_request_bytes: int
    max_n: int
    max_stop: int
    max_stop_length: int
    timeout_s: float
    max_images: int = 8
    max_image_bytes: int = 8 << 20
    max_image_pixels: int = 4096 * 4096
    max_waiting: int = 16
    turn_s: float = 0.25


def resolve_api_key(cfg) -> Optional[str]:
    """The key clients must send: ``API_KEY`` in the environment, else the config's ``api_key``."""
    return os.environ.get("API_KEY") or cfg.serve.api_key or None
