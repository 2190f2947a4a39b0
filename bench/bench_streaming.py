"""Streaming: time to the first token of a streamed chat completion against a non-streamed one's
total time, on the built-in model (SmolLM2-135M-Instruct) through API + Redis + worker.

One chat prompt, `--tokens` greedy new tokens (the prompt's greedy completion runs past them, so
every run generates all of them: checked), no capture. Two arms, interleaved run by run after one
warm-up of each:

  (a) whole  - POST /v1/chat/completions without `stream`: the time until the answer is read;
  (b) stream - the same with `stream: true`: the time until the first chunk with text arrives
               (time to first token), and until `data: [DONE]` (the whole stream).

Medians (min, max) over `--runs`, and the ratios first token / whole and streamed / whole. Every
run checks that the streamed pieces join into exactly the non-streamed text. It starts its own
Redis, worker and API in a temp dir and stops them at the end; no GPU needed.

    python bench/bench_streaming.py [--runs 7] [--tokens 64] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shared.cli.local_stack import Stack  # noqa: E402
from shared.cli.redis_server import RedisServer  # noqa: E402

START_TIMEOUT = 900.0  # the worker's first start may convert the model
PROMPT = "Write a long story about a cat who learns to sail, with many details about the sea."


def body(model: str, tokens: int, stream: bool) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": tokens,
        "temperature": 0,
        **({"stream": True, "stream_options": {"include_usage": True}} if stream else {}),
    }


def whole(client: httpx.Client, model: str, tokens: int) -> tuple[float, str]:
    started = time.perf_counter()
    response = client.post("/v1/chat/completions", json=body(model, tokens, False))
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    answer = response.json()
    if answer["usage"]["completion_tokens"] != tokens:
        raise SystemExit(f"the non-streamed job generated {answer['usage']['completion_tokens']} tokens, not {tokens}")
    return elapsed, answer["choices"][0]["message"]["content"]


def streamed(client: httpx.Client, model: str, tokens: int) -> tuple[float, float, str, int]:
    """(seconds to the first chunk with text, seconds to [DONE], the joined text, chunks with text)."""
    started = time.perf_counter()
    first, pieces, usage = None, [], None
    with client.stream("POST", "/v1/chat/completions", json=body(model, tokens, True)) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise SystemExit(f"the stream failed: {chunk['error']}")
            for choice in chunk["choices"]:
                text = choice["delta"].get("content")
                if text:
                    first = first if first is not None else time.perf_counter() - started
                    pieces.append(text)
            usage = chunk.get("usage") or usage
    done = time.perf_counter() - started
    if first is None or usage is None or usage["completion_tokens"] != tokens:
        raise SystemExit(f"the stream sent no text or not {tokens} tokens (usage {usage})")
    return first, done, "".join(pieces), len(pieces)


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    times: dict[str, list[float]] = {"whole": [], "first token": [], "stream": []}
    pieces_per_run = []
    with tempfile.TemporaryDirectory(prefix="actq-bench-stream-") as tmp, RedisServer(Path(tmp) / "redis") as redis:
        env = {"ACTQ_REDIS_URL": redis.url, "ACTQ_STORAGE_URL": (Path(tmp) / "store").as_uri()}
        env["HF_HUB_OFFLINE"] = os.environ["HF_HUB_OFFLINE"]
        with Stack(Path(tmp), env) as stack:
            stack.start_api(wait=False)
            print("starting a worker with the built-in model (the first start converts it)...", file=sys.stderr)
            stack.start_worker("bench", timeout=START_TIMEOUT)
            model = stack.models["worker-bench"]
            with httpx.Client(base_url=stack.base_url, timeout=300) as client:
                whole(client, model, args.tokens)  # warm-up of each arm
                streamed(client, model, args.tokens)
                for _ in range(args.runs):
                    elapsed, text = whole(client, model, args.tokens)
                    first, done, joined, pieces = streamed(client, model, args.tokens)
                    if joined != text:
                        raise SystemExit(f"the streamed text differs from the non-streamed one:\n{joined!r}\n{text!r}")
                    times["whole"].append(elapsed)
                    times["first token"].append(first)
                    times["stream"].append(done)
                    pieces_per_run.append(pieces)

    summary = {arm: stats(values) for arm, values in times.items()}
    whole_ms = summary["whole"]["median"]
    ratios = {
        "first token / whole": summary["first token"]["median"] / whole_ms,
        "stream / whole": summary["stream"]["median"] / whole_ms,
    }
    print(f"\n{model}, {args.tokens} greedy tokens, {args.runs} runs, {platform.processor() or platform.machine()}")
    print(f"{'arm':<34}{'median ms':>11}{'min':>9}{'max':>9}")
    labels = {
        "whole": "non-streamed answer (total)",
        "first token": "streamed: first token",
        "stream": "streamed: whole stream",
    }
    for arm, label in labels.items():
        s = summary[arm]
        print(f"{label:<34}{s['median'] * 1e3:>11.1f}{s['min'] * 1e3:>9.1f}{s['max'] * 1e3:>9.1f}")
    for name, value in ratios.items():
        print(f"{name:<34}{value:>11.3f}")
    print(f"{'text chunks per stream (median)':<34}{statistics.median(pieces_per_run):>11.0f}")
    if args.json:
        report = {"model": model, "tokens": args.tokens, "runs": args.runs, "summary": summary, "ratios": ratios}
        args.json.write_text(json.dumps({**report, "times": times, "pieces": pieces_per_run}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
