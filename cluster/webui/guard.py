"""Who may talk to the web UI: the Host and Origin a browser sends, and the access token.

A page on another site that reaches this server (DNS rebinding: evil.example resolved to
127.0.0.1, or a cross-site form) carries its own name in the Host or Origin header; those are
refused. The token is compared in constant time on the header's raw bytes.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from typing import Any

TOKEN_HEADER = "x-rayfactory-token"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("0.0.0.0", "::", "")


def allowed_hosts(host: str, extra: Iterable[str]) -> frozenset[str]:
    """Host names the Host header may carry: loopback, the bound address (unless a wildcard) and
    ``extra`` (--allow-host)."""
    names = {*LOOPBACK, *(h.strip().lower().strip("[]") for h in extra if h and h.strip())}
    if host and host not in WILDCARDS:
        names.add(host.lower().strip("[]"))
    return frozenset(names)


def refuse_open_host(host: str, token: str | None, what: str, harm: str, port: int, env: str) -> None:
    """A server bound beyond loopback without an access token is refused before it starts: anyone
    who reaches the port could ``harm`` (start jobs, use the model)."""
    from registries.errors import UserError

    if host in LOOPBACK or token:
        return
    raise UserError(
        f"--host {host} opens {what} to other machines, and anyone who reaches it can {harm}. Set an access "
        f"token (--token or {env}) and open the page with ?token=<it>, or keep the default --host 127.0.0.1 "
        f"(and forward the port: ssh -L {port}:localhost:{port}).")


def _host_name(value: str) -> str:
    """The name of a Host header or URL authority: no port, no IPv6 brackets, lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def refused_host(headers, hosts: frozenset[str]) -> str | None:
    """Why a request's Host or Origin is refused, or None. A page on another site that reaches
    this server (DNS rebinding: evil.example resolved to 127.0.0.1) carries its own name in both."""
    allow = "start the web UI with --allow-host <name> to allow another name"
    host = headers.get("host", "")
    if _host_name(host) not in hosts:
        return (f"Host {host!r} refused: this web UI answers only to {', '.join(sorted(hosts))} "
                f"(DNS rebinding guard); {allow}.")
    origin = headers.get("origin")
    if origin is not None:
        scheme, _, authority = origin.partition("://")
        if scheme.lower() not in ("http", "https") or _host_name(authority.split("/", 1)[0]) not in hosts:
            return (f"Origin {origin!r} refused: only pages served by this web UI may call it "
                    f"({', '.join(sorted(hosts))}); {allow}.")
    return None


def token_matches(scope: dict[str, Any], token: str) -> bool:
    """Constant-time comparison of the token header's raw bytes (any bytes: a wrong token, never a crash)."""
    name = TOKEN_HEADER.encode("latin-1")
    given = next((value for key, value in scope.get("headers", ()) if key.lower() == name), b"")
    return hmac.compare_digest(given, token.encode("utf-8"))
