"""Load on the OpenAI-compatible Serve app: many chat completions over loopback, bounded concurrency.

    .venv/bin/python benchmarks/serve_load.py                          # hf, 200 requests, 32 at a time
    .venv/bin/python benchmarks/serve_load.py --backend vllm --requests 200 --max-tokens 16
    .venv/bin/python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model my-model  # a running server

Without --url it starts a local Ray + Serve with the tiny Qwen2 model (or --model-path) on a free
port, then sends the requests. Prints p50/p95 latency, completion tokens/s, requests/s and errors.
Figures, not asserts: on a shared machine they vary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

TINY = "tiny:qwen2,num_heads=2"  # head size 32: vLLM's CPU attention accepts it
PROMPTS = ["What is 2 + 3?", "Say something about the sea.", "count to five", "Name three colours."]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("hf", "vllm"), default="hf", help="the engine behind ChatModel")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--model-path", default=TINY, help="model_name_or_path of the served model")
    parser.add_argument("--template", default="qwen")
    parser.add_argument("--url", help="an already running server (skips starting one)")
    parser.add_argument("--model", help="the model name to request (default: the first of GET /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("API_KEY"))
    parser.add_argument("--stream", action="store_true", help="stream the replies (SSE)")
    parser.add_argument("--json", help="also write the figures to this file")
    return parser.parse_args(argv)


def start_server(args: argparse.Namespace) -> str:
    from ray import serve

    from cluster.serve.app import build_app
    from fabric.ray_args import RayArguments
    from fabric.ray_session import connect

    config = {"model_name_or_path": args.model_path, "template": args.template, "do_sample": False,
              "max_new_tokens": args.max_tokens, "infer_backend": args.backend, "vllm_maxlen": 512,
              "serve_num_replicas": args.replicas, "serve_max_ongoing_requests": max(args.concurrency, 1),
              "serve_max_waiting": max(args.concurrency, 1)}  # the load waits its turns: no 429s
    connect(RayArguments(ray_num_cpus=max(4, args.replicas + 2)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(config, api_key=args.api_key or ""), name="serve-load", route_prefix="/")
    return f"http://127.0.0.1:{port}"


async def one(http, url: str, body: dict, stream: bool) -> tuple[float, int, str | None]:
    """(latency s, completion tokens, error) of one request."""
    start = time.perf_counter()
    try:
        if stream:
            tokens = 0
            async with http.stream("POST", url, json={**body, "stream": True,
                                                      "stream_options": {"include_usage": True}}) as answer:
                if answer.status_code != 200:
                    return time.perf_counter() - start, 0, f"HTTP {answer.status_code}"
                async for line in answer.aiter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        tokens = usage["completion_tokens"] if usage else tokens
            return time.perf_counter() - start, tokens, None
        answer = await http.post(url, json=body)
        if answer.status_code != 200:
            return time.perf_counter() - start, 0, f"HTTP {answer.status_code}: {answer.text[:120]}"
        return time.perf_counter() - start, answer.json()["usage"]["completion_tokens"], None
    except Exception as exc:  # noqa: BLE001 (a benchmark counts failures, it does not stop on them)
        return time.perf_counter() - start, 0, f"{type(exc).__name__}: {exc}"


async def load(base: str, args: argparse.Namespace) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=600, headers=headers, limits=limits) as http:
        model = args.model or (await http.get(base + "/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(args.concurrency)

        async def bounded(i: int):
            body = {"model": model, "max_tokens": args.max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} ({i})"}]}
            async with gate:
                return await one(http, base + "/v1/chat/completions", body, args.stream)

        await one(http, base + "/v1/chat/completions", {"model": model, "max_tokens": 2,  # warm-up
                                                         "messages": [{"role": "user", "content": "hi"}]}, False)
        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(args.requests)))
        wall = time.perf_counter() - start
    latencies = sorted(r[0] for r in results if r[2] is None)
    errors = [r[2] for r in results if r[2] is not None]
    tokens = sum(r[1] for r in results)

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else float("nan")

    return {"backend": args.backend, "requests": args.requests, "concurrency": args.concurrency,
            "max_tokens": args.max_tokens, "stream": args.stream, "wall_s": round(wall, 2),
            "p50_s": round(pct(0.50), 3), "p95_s": round(pct(0.95), 3),
            "mean_s": round(statistics.fmean(latencies), 3) if latencies else None,
            "completion_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "requests_per_s": round(len(latencies) / wall, 2), "errors": len(errors),
            "first_errors": errors[:3]}


def main(argv=None) -> int:
    args = parse_args(argv)
    base = args.url.rstrip("/") if args.url else start_server(args)
    try:
        figures = asyncio.run(load(base, args))
    finally:
        if not args.url:
            from ray import serve

            serve.shutdown()
    print(f"{figures['backend']}: {figures['requests']} requests, {figures['concurrency']} in flight, "
          f"max_tokens {figures['max_tokens']}: p50 {figures['p50_s']} s, p95 {figures['p95_s']} s, "
          f"{figures['tokens_per_s']} completion tokens/s, {figures['requests_per_s']} requests/s, "
          f"{figures['errors']} errors (wall {figures['wall_s']} s)")
    for error in figures["first_errors"]:
        print(f"  error: {error}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(figures, f, indent=2)
    return 1 if figures["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
