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
    ``extra`` (--allow-host; an entry with a scheme, "https://ui.example", is a whole Origin allowed)."""
    names = set(LOOPBACK)
    for entry in (h.strip().lower() for h in extra if h and h.strip()):
        if "://" in entry:  # a whole origin: it, and its name for the Host header
            names.add(entry.rstrip("/"))
            entry = _host_name(entry.split("://", 1)[1].split("/", 1)[0])
        names.add(entry.strip("[]"))
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


DEFAULT_PORTS = {"http": 80, "https": 443}


def _host_name(value: str) -> str:
    """The name of a Host header or URL authority: no port, no IPv6 brackets, lower case."""
    return _split_authority(value)[0]


def _split_authority(value: str) -> tuple[str, int | None]:
    """(name, port or None) of a Host header or URL authority, lower case, brackets off; a port that
    is not a number is kept as -1 (it matches no server)."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
    elif value.count(":") == 1:
        name, port = value.split(":")
    else:
        name, port = value, None
    if port is None:
        return name, None
    return name, int(port) if port.isdigit() and len(port) <= 5 else -1


def refused_host(headers, hosts: frozenset[str], scheme: str = "http", port: int | None = None) -> str | None:
    """Why a request's Host or Origin is refused, or None. Both are compared as whole origins: the
    name (loopback, the bound address, --allow-host), the scheme and the port this server listens on
    (``scheme``, ``port``: the request's own, from the ASGI scope). A page on another site that
    reaches this server (DNS rebinding: evil.example resolved to 127.0.0.1) carries its own name; a
    page on another port of this machine (a notebook, a dev server) its own port. --allow-host may
    also give a whole origin (https://ui.example, a proxy in front): the Host header of that name is
    then the proxy's, whatever its port, and only that exact Origin is taken."""
    allow = "start the server with --allow-host <name> to allow another name"
    host = headers.get("host", "")
    name, host_port = _split_authority(host)
    proxied = any(h.split("://", 1)[1].split("/", 1)[0].split(":")[0] == name for h in hosts if "://" in h)
    if name not in hosts or not (proxied or _same_port(host_port, scheme, port)):
        return (f"Host {host!r} refused: this server answers only to {', '.join(sorted(hosts))} on port {port} "
                f"(DNS rebinding guard); {allow}.")
    origin = headers.get("origin")
    if origin is None or origin.strip().lower().rstrip("/") in hosts:
        return None
    origin_scheme, _, authority = origin.partition("://")
    origin_name, origin_port = _split_authority(authority.split("/", 1)[0])
    if origin_scheme.lower() != scheme or origin_name not in hosts or not _same_port(origin_port, scheme, port):
        return (f"Origin {origin!r} refused: only pages served by this server may call it "
                f"({scheme}://<{', '.join(sorted(hosts))}>:{port}); {allow}.")
    return None


def listening(scope: dict[str, Any]) -> tuple[str, int | None]:
    """(scheme, port) of the socket a request came in on, from its ASGI scope."""
    server = scope.get("server") or (None, None)
    return scope.get("scheme", "http"), server[1]


def _same_port(given: int | None, scheme: str, port: int | None) -> bool:
    """A Host or Origin without a port means the scheme's default port."""
    if port is None:
        return True
    return (DEFAULT_PORTS.get(scheme) if given is None else given) == port


def token_matches(scope: dict[str, Any], token: str) -> bool:
    """Constant-time comparison of the token header's raw bytes (any bytes: a wrong token, never a crash)."""
    name = TOKEN_HEADER.encode("latin-1")
    given = next((value for key, value in scope.get("headers", ()) if key.lower() == name), b"")
    return hmac.compare_digest(given, token.encode("utf-8"))
