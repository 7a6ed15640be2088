"""The `hybridjit` command: `generate` a completion, `serve` a model over an OpenAI-compatible HTTP API, run a
`batch` of requests from a JSON-lines file for throughput, show `info` about a checkpoint, `convert` one, or show
this machine's measured `floors`.

Only the completion goes to stdout; progress, statistics and errors go to stderr. An error is one line,
`hybridjit: error: ...` (a checkpoint that does not match its config.json lists its further problems under
it), and the exit status says what kind: 2 bad input (arguments, files, checkpoints), 1 a failure nobody
foresaw (the line names its exception), 130 Ctrl-C, 141 stdout closed early (`| head`).
"""

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax.numpy as jnp

from hybridjit import __version__
from hybridjit.auto_placement import KV_SLOTS, KV_TOKENS, device_budget, device_weight_bytes
from hybridjit.convert import WEIGHT_FORMATS, convert_checkpoint
from hybridjit.model_files import open_checkpoint
from hybridjit.models.registry import ModelConfig
from hybridjit.offline_policy import EXPERTS
from hybridjit.placement import Placement
from hybridjit.resolve import resolve_model
from hybridjit.serving.scheduler import DISAGGREGATE
from hybridjit.tokenizer import check_unicode
from hybridjit.weights import routed_expert_bytes

MAX_SEED = 2**64  # the API's seeds: non-negative integers below this
DEFAULT_MODEL_NAME = "default"  # what `serve` calls the embedded model


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _note(args, message: str):
    """A line on stderr about the run, unless --quiet."""
    if not args.quiet:
        print(message, file=sys.stderr, flush=True)


class LoadingProgress:
    """One self-overwriting line on stderr: bytes of weights taken so far, and the rate."""

    def __init__(self):
        self.start = time.perf_counter()
        self.last = 0.0

    def __call__(self, done: int, total: int):
        now = time.perf_counter()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        print(
            f"\rloading weights {100 * done / max(total, 1):5.1f}% ({_gib(done)} of {_gib(total)}, "
            f"{_gib(int(rate))}/s)",
            end="",
            file=sys.stderr,
            flush=True,
        )
        if done >= total:
            print(file=sys.stderr)


class GenerationStats:
    """Time to the first token and the decode rate after it, from the times Model.stream yields.

    A yield is one token, except that a token which completes no text (part of a multi-byte character, a
    special token) yields nothing: the count can be a little low for such text.
    """

    def __init__(self):
        self.start = time.perf_counter()
        self.first = self.last = None
        self.tokens = 0

    def tick(self):
        self.last = time.perf_counter()
        self.first = self.first or self.last
        self.tokens += 1

    def summary(self, prompt_tokens: int) -> str:
        line = f"prompt {prompt_tokens} tokens"
        if not self.tokens:
            return line + ", no new tokens"
        line += f", first token {self.first - self.start:.2f} s"
        if self.tokens > 1:
            line += f", {self.tokens} tokens at {(self.tokens - 1) / (self.last - self.first):.1f} tok/s"
        return line


def cmd_generate(args) -> int:
    import hybridjit  # deferred: jax start-up is slow and `info` does not need it
    from hybridjit.models.deepseek_v3 import ExpertSchedule

    model = hybridjit.load(args.model, dtype=args.dtype, progress=None if args.quiet else LoadingProgress())
    model.expert_schedule = ExpertSchedule(n_deferred=args.deferred_experts)
    completion = model.stream(
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        stop=args.stop,
        seed=args.seed,
    )
    _note(args, "compiling the model's programs (the first token waits for it)...")
    stats = GenerationStats()
    for delta in completion:
        print(delta, end="", flush=True)
        stats.tick()
    print(flush=True)  # the completion ends before the statistics, also when both go to one file
    _note(args, stats.summary(len(model.tokenizer.encode(args.prompt))))
    return 0


def cmd_serve(args) -> int:
    import hybridjit  # deferred, as in generate
    from hybridjit.serving.server import listening_socket, serve

    sock = listening_socket(args.host, args.port)
    model = hybridjit.load(args.model, dtype=args.dtype, progress=None if args.quiet else LoadingProgress())
    serve(
        model, model_name=args.model or DEFAULT_MODEL_NAME, sock=sock, api_key=args.api_key,
        slots=args.slots, max_queue=args.max_queue, cache_len=args.cache_len,
        prefix_cache_bytes=args.prefix_cache_mib << 20, online_placement=False if args.fixed_placement else None,
        disaggregate=args.disaggregate,
    )  # fmt: skip
    return 0


def cmd_batch(args) -> int:
    from hybridjit.serving.batch import batch  # deferred, as in generate

    if args.output.exists() and args.input.resolve() == args.output.resolve():
        raise ValueError(f"{args.output}: the output file must not be the input file")
    batch(
        args.model, args.input, args.output, dtype=args.dtype, max_tokens=args.max_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
        slots=args.slots, micro_batches=args.micro_batches, prefill_batch=args.prefill_batch,
        experts=args.experts, cpu_blocks=args.cpu_blocks, widened=args.widened, kv_in_host=args.kv_in_host,
        attention_on_cpu=args.attention_on_cpu, progress=not args.quiet,
    )  # fmt: skip
    return 0


def _weight_format(cfg: ModelConfig, ckpt) -> str:
    by_projection = collections.defaultdict(set)  # a GGUF file's routed experts, in the types stored
    for name, info in ckpt.tensors.items():
        if ".experts." not in name or not hasattr(info, "stored") or name.endswith(("_scales", "_bias")):
            continue
        last = name.rsplit(".", 2)  # per expert "...experts.E.gate_proj.weight"; gpt-oss "...experts.down_proj_blocks"
        by_projection[last[-1].removesuffix("_blocks") if last[-1].endswith("_blocks") else last[-2]].add(info.stored)
    if by_projection:
        return "GGUF, routed experts as stored: " + ", ".join(
            f"{projection} {'/'.join(sorted(types))}" for projection, types in sorted(by_projection.items())
        )
    if cfg.fp8:
        return "fp8 e4m3, block " + "x".join(map(str, cfg.fp8.block))
    if cfg.int_quant:
        return f"int{cfg.int_quant.bits} routed experts, groups of {cfg.int_quant.group_size} input columns"
    return "unquantized"


def cmd_info(args) -> int:
    path = resolve_model(args.checkpoint)
    cfg, ckpt = open_checkpoint(path)
    by_dtype = collections.Counter()
    for info in ckpt.tensors.values():
        by_dtype[getattr(info, "stored", info.dtype)] += info.nbytes  # a GGUF tensor's stored type
    expert_bytes = routed_expert_bytes(cfg, ckpt)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    lines = [
        f"checkpoint      {path}",
        f"model type      {cfg.model_type}",
        f"layers          {cfg.num_hidden_layers} ({cfg.num_hidden_layers - n_moe} dense, {n_moe} MoE)",
        f"hidden size     {cfg.hidden_size}, vocab {cfg.vocab_size}, context {cfg.max_position_embeddings}",
        f"attention       {cfg.attention_summary}, "
        f"rope {'yarn x' + str(cfg.rope.yarn_factor) if cfg.rope.yarn_factor else 'plain'}",
        f"experts         {cfg.n_routed_experts} routed (top-{cfg.num_experts_per_tok}, {cfg.topk_method}, "
        f"{cfg.n_group} groups keep {cfg.topk_group}), {cfg.n_shared_experts} shared, "
        f"intermediate {cfg.moe_intermediate_size}",
        f"format          {_weight_format(cfg, ckpt)}",
        f"tensors         {len(ckpt.tensors)}, {_gib(ckpt.total_bytes())} "
        f"({', '.join(f'{k} {_gib(v)}' for k, v in by_dtype.most_common())})",
        f"routed experts  {_gib(expert_bytes)} in host memory; the rest {_gib(ckpt.total_bytes() - expert_bytes)}",
    ]
    if args.placement:
        lines += _placement_lines(cfg, Placement.default(args.dtype, experts=cfg.n_routed_experts), args.kv_tokens,
                                  n_moe)
    print("\n".join(lines))
    return 0


def _placement_lines(cfg: ModelConfig, placement: Placement, kv_tokens: int, n_moe: int) -> list[str]:
    """What loading would place where on this machine (hybridjit.auto_placement), as `info --placement` shows it."""
    if placement.resident_experts is None or not n_moe:
        return [f"placement       {placement.device}: no accelerator; the routed experts stay in host memory for the "
                "CPU kernels, the rest runs on XLA:CPU"]
    weights = device_weight_bytes(cfg, placement.dtype)
    plan = device_budget(cfg, placement.device, placement.dtype, kv_tokens=kv_tokens, weights_to_load=weights)
    n, e = plan.resident_per_layer, cfg.n_routed_experts
    where = "every routed expert on the device" if n == e else f"{e - n} per layer on the CPU"
    return [
        f"placement       {placement.device} ({_gib(plan.device_total)}, {jnp.dtype(placement.dtype).name}): other "
        f"weights {_gib(weights)}, free after them {_gib(plan.free_after_weights)}",
        f"  reserved      KV cache {_gib(plan.kv_cache)} ({kv_tokens} tokens in {KV_SLOTS} slots), prefill ring "
        f"{_gib(plan.prefill_ring)}, activations {_gib(plan.activations)}",
        f"  resident      {n} of {e} routed experts per MoE layer ({_gib(n * n_moe * plan.per_expert)}, "
        f"{plan.per_expert / 2**20:.1f} MiB each): {where}",
        f"  long prompts  streamed over {', '.join(map(str, placement.stream_devices))}"
        + (" (distributed: each streams its share of every layer's experts)" if len(placement.stream_devices) > 1
           else ""),
    ]


def cmd_floors(args) -> int:
    import jax  # deferred, as the other commands' JAX: measuring starts its backends

    from hybridjit import machine_floors

    cache = machine_floors.FloorCache()
    floors = cache.floors(jax.devices()[0], remeasure=args.remeasure)
    rates = cache.cpu_expert_rates(floors.machine)
    print(json.dumps({**dataclasses.asdict(floors), "cache": str(cache.path), "cpu_experts_tflops": rates}, indent=1))
    if not rates:  # a rate is of a model's expert format and shapes: measured by a model, not by this command
        why = (
            "the rate only decides whether a prompt's routed experts are streamed to an accelerator, and this "
            "machine has none"
            if floors.pcie_gbps is None
            else "a model's is measured the first time it chooses a prompt's prefill path, its routed experts in "
            "pinned host memory"
        )
        print(f"cpu_experts_tflops: none measured: {why}", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    print(convert_checkpoint(resolve_model(args.source), args.destination, args.format, overwrite=args.force))
    return 0


def utf8_text(value: str) -> str:
    """Text from the command line: bytes that are not UTF-8 arrive as surrogate escapes, which are no text."""
    try:
        return check_unicode(value)
    except ValueError:
        raise argparse.ArgumentTypeError("not valid UTF-8 text") from None


def _integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None


def positive(value: str) -> int:
    number = _integer(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return number


def non_negative(value: str) -> int:
    number = _integer(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value} is not >= 0")
    return number


def micro_batches(value: str) -> int | str:
    return value if value == "dual" else positive(value)


def port(value: str) -> int:
    number = _integer(value)
    if not 0 < number < 2**16:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (1 to 65535)")
    return number


def seed(value: str) -> int:
    number = _integer(value)
    if not 0 <= number < MAX_SEED:
        raise argparse.ArgumentTypeError(f"{value} is not in [0, 2**64)")
    return number


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default but None: the help of those options says what leaving them out does."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridjit", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt", formatter_class=HelpFormatter)
    gen.add_argument("prompt", type=utf8_text, help="the text to complete")
    gen.add_argument("--model", help="checkpoint path, repo id or name (default: the embedded model)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="sample from the likeliest tokens of this total mass")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens; 0: all")
    gen.add_argument("--seed", type=seed, default=0, help="random seed of the sampling, in [0, 2**64)")
    gen.add_argument("--stop", action="append", type=utf8_text, metavar="STRING",
                     help="end the completion before this string (repeatable)")
    gen.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (default: the backend's)")
    gen.add_argument("--deferred-experts", type=int, default=0,
                     help="Expert Deferral: routed experts per token added one layer late (changes the model)")
    gen.add_argument("--quiet", action="store_true", help="no loading progress, compile note or statistics")
    gen.set_defaults(run=cmd_generate)
    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                         formatter_class=HelpFormatter)
    srv.add_argument("--model", help="checkpoint path, repo id or name (default: the embedded model, "
                     f"served as {DEFAULT_MODEL_NAME!r})")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    srv.add_argument("--port", type=port, default=8000, help="TCP port to listen on")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: no key)")
    srv.add_argument("--slots", type=positive, default=8, help="requests decoded together")
    srv.add_argument("--max-queue", type=positive, default=64,
                     help="requests that may wait for a slot; more are turned away with 429")
    srv.add_argument("--cache-len", type=positive,
                     help="KV positions each slot holds, prompt and completion (default: the model's context, at most "
                          "32768)")
    srv.add_argument("--prefix-cache-mib", type=non_negative, default=1024,
                     help="memory for the KV of earlier prompts' prefixes, reused by later ones (0: off)")
    srv.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (default: the backend's)")
    srv.add_argument("--fixed-placement", action="store_true",
                     help="keep the resident experts chosen at load (default: re-place them by the traffic's use "
                          "while serving, when some but not all of them fit on the GPU)")
    srv.add_argument("--disaggregate", choices=DISAGGREGATE, default="auto",
                     help="with several GPUs, where long prompts stream: auto, on the GPUs that do not decode while "
                          "requests decode and over all of them otherwise; always, on those GPUs; never, over all")
    srv.add_argument("--quiet", action="store_true", help="no loading progress")
    srv.set_defaults(run=cmd_serve)
    bat = sub.add_parser("batch", help="complete every request of a JSON-lines file, for throughput (resumable)",
                         formatter_class=HelpFormatter,
                         description="Each input line: {\"id\": ..., \"prompt\": \"text\" or [token ids]} or "
                         "{\"id\": ..., \"messages\": [...]}, with optional max_tokens, temperature, top_p, top_k, "
                         "seed, stop (the server's fields). Each output line: id, text, token_ids, prompt_tokens, "
                         "completion_tokens, finish_reason. Rerun after an interruption: ids already in OUT are "
                         "skipped.")
    bat.add_argument("input", type=Path, help="requests, one JSON object per line")
    bat.add_argument("output", type=Path, help="completions, one JSON object per line, appended to")
    bat.add_argument("--model", help="checkpoint path, repo id or name (default: the embedded model)")
    bat.add_argument("--max-tokens", type=positive, default=256, help="most tokens per request that gives none")
    bat.add_argument("--temperature", type=float,
                     help="sampling temperature of requests that give none; 0 is greedy (default: 1, as the server)")
    bat.add_argument("--top-p", type=float, help="top_p of requests that give none (default: 1)")
    bat.add_argument("--top-k", type=non_negative, help="top_k of requests that give none (default: 0, all)")
    bat.add_argument("--seed", type=seed,
                     help="seed of requests that give none (default: one derived from each request's id)")
    bat.add_argument("--stop", action="append", type=utf8_text, metavar="STRING",
                     help="stop string of requests that give none (repeatable)")
    bat.add_argument("--slots", type=positive, help="sequences decoded together (default: the performance model's)")
    bat.add_argument("--micro-batches", type=micro_batches, metavar="N|dual",
                     help="attention micro-batches of a decode step, whose routed experts run as one call, or 'dual': "
                          "two overlapped micro-batches with expert calls of their own (default: the performance "
                          "model's)")
    bat.add_argument("--prefill-batch", type=positive,
                     help="prompts prefilled together (default: the performance model's)")
    bat.add_argument("--experts", choices=EXPERTS,
                     help="where a decode step's routed experts run: 'cpu' (the CPU kernels) or 'stream' (streamed to "
                          "the GPU each step, for large batches) (default: the performance model's)")
    bat.add_argument("--cpu-blocks", type=non_negative, metavar="N",
                     help="with the experts streamed: how many of each layer's 8 expert blocks the CPU computes while "
                          "the others stream (co-execution) (default: the performance model's)")
    bat.add_argument("--widen", dest="widened", action=argparse.BooleanOptionalAction,
                     help="with every routed expert resident on the GPU in FP8: hold them dequantized for the run "
                          "(faster large steps, twice their memory) or not (default: the performance model's)")
    bat.add_argument("--kv-in-host", action=argparse.BooleanOptionalAction,
                     help="with the experts streamed: hold the KV cache in pinned host memory, copied to the GPU a "
                          "layer at a time (more slots than the GPU holds) or on the GPU (default: the performance "
                          "model's)")
    bat.add_argument("--attention-on-cpu", action=argparse.BooleanOptionalAction,
                     help="with the KV cache in host memory: the CPU attends over it there (only the experts cross "
                          "to the GPU) or the GPU does, a layer of it copied at a time (default: the GPU; the CPU "
                          "only where asked for, as it measured no faster on a 16-core host: bench/RESULTS.md)")
    bat.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (default: the backend's)")
    bat.add_argument("--quiet", action="store_true", help="no progress bar or notes")
    bat.set_defaults(run=cmd_batch)
    info = sub.add_parser("info", help="describe a checkpoint without loading its weights",
                          formatter_class=HelpFormatter)
    info.add_argument("checkpoint", nargs="?", help="checkpoint path, repo id or name (default: the embedded model)")
    info.add_argument("--placement", action="store_true",
                      help="also what loading would place on this machine's accelerator: the memory it would "
                           "reserve and the routed experts it would hold there (load(placement='auto'))")
    info.add_argument("--kv-tokens", type=non_negative, default=KV_TOKENS,
                      help="tokens of KV cache the placement reserves device memory for, over "
                           f"{KV_SLOTS} slots")
    info.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (default: the backend's)")
    info.set_defaults(run=cmd_info)
    floors = sub.add_parser("floors", help="this machine's rates that the cost models choose with, measured once "
                            "and cached ($HYBRIDJIT_CACHE/floors.json)", formatter_class=HelpFormatter)
    floors.add_argument("--remeasure", action="store_true", help="measure them again and replace the cached ones")
    floors.set_defaults(run=cmd_floors)
    convert = sub.add_parser("convert", help="re-store a checkpoint's weights in another format",
                             formatter_class=HelpFormatter)
    convert.add_argument("source", help="checkpoint path, repo id or name")
    convert.add_argument("destination", help="directory of the new checkpoint")
    convert.add_argument("--format", required=True, choices=WEIGHT_FORMATS,
                         help="fp8 or bf16 weights; int8 or int4 routed experts (the rest bf16)")
    convert.add_argument("--force", action="store_true", help="replace a destination that is not empty")
    convert.set_defaults(run=cmd_convert)
    return parser


def _error(message, status: int) -> int:
    print(f"hybridjit: error: {message}", file=sys.stderr)
    return status


def _stdout_closed() -> int:
    """The reader of stdout went away (`| head`): end quietly, as a program that SIGPIPE kills would.

    stdout is pointed at devnull so that Python's flush at exit does not fail again (the recipe of the
    `signal` module's documentation). The status is 141 (128 + SIGPIPE), what shells report for such a
    program: scripts under `set -o pipefail` can tell it from a failure, which 1 would say.
    """
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        if sys.stderr.isatty():  # the cursor is after the echoed ^C: start the line afresh
            print(file=sys.stderr)
        return _error("interrupted", 130)
    except BrokenPipeError:
        return _stdout_closed()
    except (ValueError, FileNotFoundError) as e:  # ours name the file, tensor or argument at fault
        return _error(e, 2)
    except Exception as e:  # not foreseen: still one line, naming the exception for the bug report
        return _error(f"{type(e).__name__}: {e}", 1)


if __name__ == "__main__":
    sys.exit(main())
