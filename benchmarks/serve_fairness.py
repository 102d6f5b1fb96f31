"""A short request behind a long one on the transformers engine of the Serve app.

    .venv/bin/python benchmarks/serve_fairness.py                       # tiny Qwen2, 2 rounds per case
    .venv/bin/python benchmarks/serve_fairness.py --model-path demo:smollm2-135m-instruct --template llama3
    .venv/bin/python benchmarks/serve_fairness.py --set serve_turn_s=0.1   # any serve key

Starts a local Ray + Serve (loopback) with one replica, sends a long request (one reply of
--long-tokens, or --wide-n replies of --wide-tokens each), waits --head-start seconds so it is
generating, then sends a 1-token request and prints how long that one took, next to the same
request alone. The long reply is greedy and the wide one seeded, so each round (and each version
of the code) generates the same tokens; their counts are printed. Figures, not asserts: on a
shared machine they vary.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

TINY = "tiny:qwen2,num_heads=2"
HELLO = [{"role": "user", "content": "hello"}]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=TINY, help="model_name_or_path of the served model")
    parser.add_argument("--template", default="qwen")
    parser.add_argument("--long-tokens", type=int, default=1200, help="the one long reply's length")
    parser.add_argument("--wide-n", type=int, default=16, help="replies of the wide request")
    parser.add_argument("--wide-tokens", type=int, default=1000, help="tokens in each reply of the wide request")
    parser.add_argument("--head-start", type=float, default=0.3, help="seconds the long request generates first")
    parser.add_argument("--rounds", type=int, default=2, help="measurements per case (the median is printed)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another config key")
    return parser.parse_args(argv)


def start_server(args: argparse.Namespace) -> str:
    from ray import serve

    from cluster.serve.app import build_app
    from fabric.ray_args import RayArguments
    from fabric.ray_session import connect

    config = {"model_name_or_path": args.model_path, "template": args.template, "do_sample": False,
              "vllm_maxlen": max(args.long_tokens, args.wide_tokens) + 64, "serve_max_n": max(args.wide_n, 1),
              "serve_request_timeout_s": 3600}
    for item in args.set:
        key, _, value = item.partition("=")
        config[key] = value
    connect(RayArguments(ray_num_cpus=4))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config, api_key=""), name="serve-fairness", route_prefix="/")
    return f"http://127.0.0.1:{port}/v1/chat/completions"


async def behind(http, url: str, model: str, long_body: dict | None, head_start: float) -> dict:
    """The 1-token request's latency, sent ``head_start`` s after ``long_body`` (None: alone)."""
    long_task, sent = None, time.perf_counter()
    if long_body is not None:
        long_task = asyncio.create_task(http.post(url, json={"model": model, "messages": HELLO, **long_body}))
        await asyncio.sleep(head_start)
    start = time.perf_counter()
    short = await http.post(url, json={"model": model, "messages": HELLO, "max_tokens": 1})
    figures = {"short_s": time.perf_counter() - start, "short_status": short.status_code}
    if long_task is not None:
        answer = await long_task
        figures["long_s"] = time.perf_counter() - sent
        figures["long_status"] = answer.status_code
        figures["long_tokens"] = answer.json()["usage"]["completion_tokens"] if answer.status_code == 200 else 0
    return figures


async def measure(url: str, args: argparse.Namespace) -> list[tuple[str, dict]]:
    import httpx

    cases = [("alone", None),
             (f"behind 1 x {args.long_tokens} tokens", {"max_tokens": args.long_tokens, "temperature": 0}),
             (f"behind n {args.wide_n} x {args.wide_tokens} tokens",
              {"max_tokens": args.wide_tokens, "n": args.wide_n, "temperature": 1, "seed": 0})]
    async with httpx.AsyncClient(timeout=3600) as http:
        model = (await http.get(url.replace("/chat/completions", "/models"))).json()["data"][0]["id"]
        await behind(http, url, model, None, 0)  # warm-up
        results = []
        for name, body in cases:
            rounds = [await behind(http, url, model, body, args.head_start) for _ in range(args.rounds)]
            results.append((name, {"short_s": statistics.median(r["short_s"] for r in rounds),
                                   "statuses": sorted({r["short_status"] for r in rounds}),
                                   "long_tokens": [r.get("long_tokens") for r in rounds],
                                   "long_s": statistics.median(r.get("long_s", 0) for r in rounds)}))
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    url = start_server(args)
    try:
        results = asyncio.run(measure(url, args))
    finally:
        from ray import serve

        serve.shutdown()
    print(f"{args.model_path}, head start {args.head_start} s, median of {args.rounds}; extra keys: {args.set or 'none'}")
    for name, figures in results:
        longs = (f"; the long request: {figures['long_s']:.2f} s, {figures['long_tokens']} tokens"
                 if figures["long_tokens"][0] is not None else "")
        print(f"  1-token request {name}: {figures['short_s']:.2f} s (HTTP {figures['statuses']}){longs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
