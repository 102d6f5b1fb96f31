"""``rayfactory webchat cfg.yaml``: one model, one chat page (LLaMA-Factory's webchat).

Only the command's arguments live here (standard library only), so ``rayfactory --help`` does not
import the web stack; the server is cluster/webchat/server.py, loaded when the command runs.
"""

from __future__ import annotations

import argparse
import os

DEFAULT_PORT = 7861  # beside the web UI's 7860, so both can run at once
TOKEN_ENV = "RAYFACTORY_WEBCHAT_TOKEN"

DESCRIPTION = """\
Chat with one model in the browser: the model of CONFIG (model_name_or_path, plus
adapter_name_or_path or a merged export), loaded as `rayfactory chat` loads it, on the same
engine (infer_backend: huggingface or vllm). The page streams each reply token by token and has
a system prompt box, temperature / top_p / max_new_tokens, Stop and Clear. Ray is not started.

The page listens on http://127.0.0.1:7861 (loopback only). Another --host needs an access token
(--token or $RAYFACTORY_WEBCHAT_TOKEN; open the page with ?token=...), and browsers must then
reach it by that host's name or one given with --allow-host. Request limits come from the
config's serve keys (serve_max_request_bytes, serve_max_ongoing_requests, serve_request_timeout_s).
"""


def add_webchat_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = DESCRIPTION
    parser.add_argument("config", help="YAML with model_name_or_path (+ adapter_name_or_path, template, "
                                       "generation keys, default_system)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys, e.g. temperature=0")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--token", default=os.environ.get(TOKEN_ENV),
                        help=f"access token the page must send (required with a non-loopback --host); default ${TOKEN_ENV}")
    parser.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                        help="another host name the browser may use (repeatable; loopback names and --host are "
                             "always allowed)")
    return parser
