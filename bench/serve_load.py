"""Server benchmark: `hybridjit serve` under 1, 8 and 32 concurrent streaming clients (the official openai client),
and the server's overhead on a single stream against the scheduler driven in process.

    python bench/serve_load.py [--model NAME_OR_PATH] [--streams 1 8 32] [--requests 64] [--max-tokens 64]

Each stream sends completions back to back (greedy, fixed length, prompts drawn from the stdlib corpus of the
embedded model); reported per concurrency: sustained output tokens/s over the whole run, and p50 / p99 of
TTFT (request sent to first token received) and TPOT (mean gap between a request's tokens after its first).
Overhead: single-stream TPOT through HTTP / TPOT of the same requests through an in-process Scheduler on
the same model and machine. Ends with one JSON line.
"""

import argparse
import concurrent.futures
import json
import socket
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import openai

import hybridjit
from floors import machine
from hybridjit.models.stdlib_corpus import corpus_files, read_text
from hybridjit.serving.scheduler import Finished, Request, Scheduler, Token


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def corpus_prompts(n: int) -> list[str]:
    """n prompts of ~300 characters from the held-out files of the embedded model's corpus."""
    _, held_out = corpus_files(Path(sysconfig.get_paths()["stdlib"]))
    texts = [read_text(p) for p in held_out[:n]]
    return [t[len(t) // 3 :][:300] for t in texts if len(t) > 1000][:n]


def timed_stream(client, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(TTFT s, TPOT s, tokens) of one streamed completion."""
    sent, times = time.perf_counter(), []
    for chunk in client.completions.create(model="default", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           stream=True):
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    return times[0] - sent, tpot, len(times)


def load_case(base_url: str, prompts: list[str], streams: int, requests: int, max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda i: timed_stream(client, prompts[i % len(prompts)], max_tokens),
                                range(requests)))
    elapsed = time.perf_counter() - start
    ttft = [r[0] for r in results]
    tpot = [r[1] for r in results if r[1] == r[1]]
    return {"streams": streams, "requests": requests, "tokens_per_s": round(sum(r[2] for r in results) / elapsed, 1),
            "ttft_p50_ms": round(1e3 * percentile(ttft, 50), 1), "ttft_p99_ms": round(1e3 * percentile(ttft, 99), 1),
            "tpot_p50_ms": round(1e3 * percentile(tpot, 50), 2), "tpot_p99_ms": round(1e3 * percentile(tpot, 99), 2)}


def engine_tpot(model_name: str | None, prompts: list[str], max_tokens: int, n: int, slots: int) -> float:
    """Median TPOT of n requests, one at a time, through a Scheduler of `slots` in this process."""
    model = hybridjit.load(model_name)
    scheduler = Scheduler(model, slots=slots, prefix_cache_bytes=0)
    scheduler.start()
    tpots = []
    try:
        for i in range(n + 2):
            times, done = [], threading.Event()

            def on_event(event, times=times, done=done):
                if isinstance(event, Token):
                    times.append(time.perf_counter())
                elif isinstance(event, Finished):
                    done.set()

            scheduler.submit(Request(model.tokenizer.encode(prompts[i % len(prompts)]), max_tokens), on_event)
            done.wait(600)
            if i >= 2:  # the first ones compile
                tpots.append((times[-1] - times[0]) / (len(times) - 1))
    finally:
        scheduler.shutdown()
        model.close()
    return statistics.median(tpots)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="NAME_OR_PATH (default: the embedded model)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=64, help="requests per concurrency (at least the streams)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=32)
    args = parser.parse_args(argv)
    prompts = corpus_prompts(16)
    port = free_port()
    command = [sys.executable, "-m", "hybridjit", "serve", "--port", str(port), "--slots", str(args.slots),
               "--max-queue", "256", "--quiet", *(["--model", args.model] if args.model else [])]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # no access log
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        for _ in range(600):
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.5)
        for streams in args.streams:  # warm-up: compile every program each concurrency uses
            load_case(base_url, prompts, streams, streams, 4)
        single = []
        print(f"{'streams':>7} {'tok/s':>8} {'TTFT p50':>9} {'p99 ms':>8} {'TPOT p50':>9} {'p99 ms':>8}")
        for streams in args.streams:
            r = load_case(base_url, prompts, streams, max(args.requests, streams), args.max_tokens)
            print(f"{streams:7d} {r['tokens_per_s']:8.1f} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:8.1f} "
                  f"{r['tpot_p50_ms']:9.2f} {r['tpot_p99_ms']:8.2f}", flush=True)
            single.append(r)
    finally:
        server.terminate()
        server.wait(60)
    http = next((r["tpot_p50_ms"] for r in single if r["streams"] == 1), None)
    engine = 1e3 * engine_tpot(args.model, prompts, args.max_tokens, 8, args.slots)
    overhead = round(http / engine, 3) if http else None
    print(f"single stream TPOT: HTTP {http} ms, in-process scheduler {engine:.2f} ms: overhead x{overhead}")
    print(json.dumps({"bench": "serve_load", "model": args.model or "default", "machine": machine(),
                      "max_tokens": args.max_tokens, "slots": args.slots, "results": single,
                      "single_stream": {"http_tpot_ms": http, "engine_tpot_ms": round(engine, 2),
                                        "overhead": overhead}}))


if __name__ == "__main__":
    main()
