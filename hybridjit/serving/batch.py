"""`hybridjit.batch`: many requests through one model for throughput (evaluation sets, data extraction,
synthetic data), written to a JSON-lines file that a rerun resumes.

    records = hybridjit.batch("deepseek-v3", "prompts.jsonl", "completions.jsonl", max_tokens=256, temperature=0)

Input (batch_requests.py): one JSON object per line (or a list of dicts), {"id": ..., "prompt": "text" or
[token ids]} or {"id": ..., "messages": [chat messages]}, with the server's optional sampling fields.
Output (batch_output.py): one line per request as it finishes, {"id", "text", "token_ids", "prompt_tokens",
"completion_tokens", "finish_reason"}; requests whose id is already in the output file are skipped.
The throughput policy (slots, attention micro-batches, prefill batch) is the performance model's
(hybridjit/offline_policy.py) unless given.
"""

import contextlib
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from tqdm import tqdm

from hybridjit.host_kv_cache import host_memory_bytes
from hybridjit.offline_policy import DUAL, Floors, choose_policy
from hybridjit.pinned_experts import open_host_memory_pool
from hybridjit.serving.batch_output import ResumableOutput
from hybridjit.serving.batch_requests import check_defaults, encode_requests, id_key, read_requests
from hybridjit.serving.throughput import Completion, ThroughputRunner, cache_len_for


def batch(
    model,
    requests: str | Path | Iterable[dict],
    output: str | Path | None = None,
    *,
    max_tokens: int = 256,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | list[str] | None = None,
    slots: int | None = None,
    micro_batches: int | str | None = None,
    prefill_batch: int | None = None,
    experts: str | None = None,
    cpu_blocks: int | None = None,
    widened: bool | None = None,
    kv_in_host: bool | None = None,
    attention_on_cpu: bool | None = None,
    progress: bool = True,
    dtype: str | None = None,
    floors: Floors | None = None,
) -> list[dict]:
    """Completes every request; returns their output records in the requests' order (those found in `output`
    from an earlier run included).

    `model`: a loaded hybridjit Model, or a name, repo id or path to load (and close afterwards).
    `requests`: a JSON-lines file, or dicts of the same form. Every request is checked before anything runs:
    ValueError (BatchInputError) lists each bad one with its line number and field.
    `output`: the JSON-lines file to append to (None: keep the records in memory only).
    `max_tokens` ... `stop`: the values of those fields for requests that give none (None: the server's
    defaults: temperature 1, top_p 1, top_k 0 (all), no stop strings; a request without a seed gets one derived
    from its id, so that a resumed batch samples what an uninterrupted one would).
    `slots`, `micro_batches`, `prefill_batch`: override the performance model's policy: sequences decoded
    together, attention micro-batches of a step (whose routed experts run coalesced, one call per layer) or
    "dual" (two micro-batches overlapped, each with its own expert calls: the interactive engine's), prompts
    prefilled together, and where each decode step's routed experts run: "cpu" (the CPU kernels) or "stream"
    (streamed to the GPU each step, for large batches; needs a model loaded with its experts pinned, as on a GPU),
    and with "stream", `cpu_blocks`: how many of each layer's expert blocks (pinned_experts.BLOCKS_PER_LAYER) the
    CPU kernels compute while the others stream (co-execution; 0: none).
    `widened`: with every routed expert resident on the device in FP8, whether the run holds them dequantized in the
    compute dtype (large steps skip dequantizing them each step, at twice their device bytes; as stored again
    when the run ends).
    `kv_in_host`: with the experts streamed, whether the KV cache is held in pinned host memory and copied to the
    GPU a layer at a time (more slots than the device's memory holds, for the link's time; host_kv_cache.py).
    `attention_on_cpu`: with the KV cache in host memory, whether the CPU attends over it there instead (only the
    experts then cross the link).
    `progress`: a progress bar (tokens/s, ETA) and notes on stderr.
    `dtype`: the compute dtype of a model loaded here (as hybridjit.load's).
    `floors`: the machine's rates the performance model reads (default: offline_policy.Floors.of_machine, this
    machine's measured floors on a GPU, with the device's free memory measured).
    """
    given = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
             "stop": stop}  # fmt: skip
    defaults = check_defaults({k: v for k, v in given.items() if v is not None})
    source, lines = _lines(requests)
    parsed = read_requests(lines, source, defaults)
    overrides = (slots, micro_batches, prefill_batch, floors, experts, cpu_blocks, widened, kv_in_host,
                 attention_on_cpu)
    if isinstance(model, str | Path) or model is None:
        from hybridjit.engine import load  # deferred: loading starts JAX

        # A run that loads its own model lets the pinned pool grow to the host's memory (before JAX starts): a KV
        # cache in host memory, if the policy picks one, is then bounded by what the host has available, not by the
        # pool that load() sizes for the experts alone.
        if (total := host_memory_bytes("MemTotal")) is not None:
            open_host_memory_pool(total // 2**30)
        _note(progress, f"loading {model or 'the embedded model'}...")
        with contextlib.closing(load(model, dtype=dtype)) as loaded:
            return _run(loaded, parsed, source, output, overrides, progress, owned=True)
    return _run(model, parsed, source, output, overrides, progress, owned=False)


def _lines(requests) -> tuple[str, Iterable[tuple[str, str | dict]]]:
    """(what errors call the input, (where, line) pairs)."""
    if isinstance(requests, str | Path):
        path = Path(requests)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: {'is a directory' if path.is_dir() else 'no such file'}; the input is a "
                                    "JSONL file")
        with open(path, encoding="utf-8", errors="strict") as f:
            try:
                text = f.read()
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: not UTF-8 text ({e})") from None
        return str(path), ((f"line {n}", line) for n, line in enumerate(text.splitlines(), 1))
    return "requests", ((f"request {n}", request) for n, request in enumerate(requests))


def _note(progress: bool, message: str):
    if progress:
        print(message, file=sys.stderr, flush=True)


def _run(model, parsed, source: str, output, overrides: tuple, progress: bool, owned: bool) -> list[dict]:
    """`owned`: the model was loaded for this run and is closed after it."""
    jobs = encode_requests(model, parsed, source)
    out = ResumableOutput(output) if output is not None else None
    try:
        done = out.done if out is not None else {}
        if out is not None and out.truncated:
            _note(progress, f"{out.path}: removed a torn last line ({out.truncated} bytes) left by an interrupted run")
        todo = [j for j in jobs if id_key(j.key.id) not in done]
        if len(todo) < len(jobs):
            _note(progress, f"resuming: {len(jobs) - len(todo)} of {len(jobs)} requests are already in {out.path}")
        if todo:
            _complete(model, todo, out, done, overrides, progress, owned)
        return [done[id_key(j.key.id)] for j in jobs]
    finally:
        if out is not None:
            out.close()


def _complete(model, todo, out: ResumableOutput | None, done: dict, overrides: tuple, progress: bool, owned: bool):
    cache_len = cache_len_for(model, todo)
    policy = choose_policy(model, todo, cache_len, *overrides)
    _note(progress, policy.describe())
    micro_batches = None if policy.micro_batches == DUAL else policy.micro_batches  # None: the Engine's dual overlap
    try:
        model.hold_resident_experts(policy.widened)
        with policy.cpu_pool():
            _decode_all(model, todo, out, done, policy, micro_batches, cache_len, progress)
    finally:
        if not owned:  # as stored again, as interactive decode reads them fastest (a model closed next needs not)
            model.hold_resident_experts(widened=False)


def _decode_all(model, todo, out: ResumableOutput | None, done: dict, policy, micro_batches, cache_len: int,
                progress: bool):  # fmt: skip
    runner = ThroughputRunner(
        model, slots=policy.slots, micro_batches=micro_batches, prefill_batch=policy.prefill_batch, cache_len=cache_len,
        stream_experts=policy.experts == "stream", cpu_blocks=policy.cpu_blocks, kv_in_host=policy.kv_in_host,
        attention_on_cpu=policy.attention_on_cpu,
    )
    bar = tqdm(total=sum(j.max_tokens for j in todo), unit="tok", desc="generating", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)  # fmt: skip
    start, generated, finished = time.perf_counter(), 0, 0
    with bar:
        for completion in runner.run(todo, on_tokens=bar.update):
            record = _record(completion)
            if out is not None:
                out.write_lines([record])
            done[id_key(record["id"])] = record
            generated += record["completion_tokens"]
            finished += 1
            # A request that ended early gives back the tokens it did not use: the ETA stays honest.
            bar.total -= completion.job.max_tokens - record["completion_tokens"]
            bar.set_postfix_str(f"{finished}/{len(todo)} requests", refresh=False)
    seconds = time.perf_counter() - start
    prompt_tokens = sum(len(j.prompt) for j in todo)
    _note(progress, f"{len(todo)} requests, {prompt_tokens} prompt tokens and {generated} generated in "
                    f"{seconds:.1f} s: {generated / seconds:.1f} generated tok/s")  # fmt: skip


def _record(completion: Completion) -> dict:
    return {
        "id": completion.job.key.id,
        "text": completion.text,
        "token_ids": completion.token_ids,
        "prompt_tokens": len(completion.job.prompt),
        "completion_tokens": len(completion.token_ids),
        "finish_reason": completion.finish_reason,
    }
