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
    api_port: int = 8000
    api_key: Optional[str] = None  # when set, every request needs "Authorization: Bearer <key>"
    serve_num_replicas: int = 1
    # Ray Serve autoscaling_config (min_replicas, max_replicas, target_ongoing_requests, ...);
    # when set it replaces serve_num_replicas.
    serve_autoscaling: Optional[dict[str, Any]] = None
    serve_max_ongoing_requests: int = 64  # per replica; more wait in Serve's queue
    serve_replica_resources: dict[str, float] = field(default_factory=lambda: {"CPU": 1})
    # What one request may ask for: more is answered with a 4xx before any work starts.
    serve_max_request_bytes: int = 1 << 20  # the JSON body (1 MiB; the prompt-token cap is vllm_maxlen)
    serve_max_n: int = 16  # choices per request
    serve_max_stop: int = 16  # stop strings per request (OpenAI allows 4)
    serve_max_stop_length: int = 256  # characters in one stop string
    serve_request_timeout_s: float = 300  # a request still generating this long after its first token is stopped (408)
    serve_docs: bool = False  # /docs and /openapi.json (their page loads scripts from a CDN)
    # Images (a vision model's image_url parts, base64 data URLs): each is also inside the request
    # body, so serve_max_request_bytes bounds them too; raise it for large pictures.
    serve_max_images: int = 8  # image parts per request
    serve_max_image_bytes: int = 8 << 20  # one image's decoded file (8 MiB)
    serve_max_image_pixels: int = 4096 * 4096  # one image's width x height, read from its header

    def request_limits(self) -> "RequestLimits":
        return RequestLimits(self.serve_max_request_bytes, self.serve_max_n, self.serve_max_stop,
                             self.serve_max_stop_length, self.serve_request_timeout_s, self.serve_max_images,
                             self.serve_max_image_bytes, self.serve_max_image_pixels)

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


def resolve_api_key(cfg) -> Optional[str]:
    """The key clients must send: ``API_KEY`` in the environment, else the config's ``api_key``."""
    return os.environ.get("API_KEY") or cfg.serve.api_key or None
