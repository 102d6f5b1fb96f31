"""The serve group of a config: where the endpoint listens, who may call it, how it scales.

Host, port and key follow LLaMA-Factory's ``api``: the ``API_HOST`` / ``API_PORT`` / ``API_KEY``
environment variables, then these keys, then 127.0.0.1:8000 with no key; ``--host`` / ``--port``
on the command line win over all of them (resolved once, in cluster/cli.py).
"""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if not 0 < self.api_port < 65536:
            raise ArgumentError("api_port", f"api_port must be a TCP port (1-65535), got {self.api_port}.")
        if self.serve_num_replicas < 1:
            raise ArgumentError("serve_num_replicas", f"serve_num_replicas must be at least 1, got {self.serve_num_replicas}.")
        if self.serve_max_ongoing_requests < 1:
            raise ArgumentError(
                "serve_max_ongoing_requests",
                f"serve_max_ongoing_requests must be at least 1, got {self.serve_max_ongoing_requests}.",
            )
