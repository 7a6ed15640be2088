"""Quality of the shipped model under each weight format and decode-time approximation.

    python bench/quality.py [--model PATH] [--windows 48] [--length 256]

Held-out perplexity and next-token accuracy on Python standard-library files the model never trained on
(the split of hybridjit.models.stdlib_corpus), against a unigram baseline fitted on the training files. Rows:
the BF16 checkpoint as shipped; its FP8 block-scaled variant; INT8 and INT4 routed experts (converted here
with hybridjit.convert); Expert Deferral and Expert Skipping with 1..k-1 affected experts. Deferral and
skipping are decode-time mechanisms, so every row is scored by teacher-forced decoding through the decode
step (the plain decode row must equal the whole-sequence row, which is reported as a check). Ends with one
JSON line.
"""

import argparse
import json
import math
import sysconfig
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from tokenizers import Tokenizer

import hybridjit
from hybridjit.convert import convert_checkpoint
from hybridjit.models import deepseek_v3 as dsv3
from hybridjit.models.stdlib_corpus import corpus_files, token_stream
from hybridjit.resolve import default_model_dir


def heldout_windows(tokenizer: Tokenizer, count: int, length: int, seed: int = 0) -> np.ndarray:
    """count windows of length+1 tokens from the held-out files, at seeded random offsets."""
    _, heldout = corpus_files(Path(sysconfig.get_paths()["stdlib"]))
    stream = token_stream(tokenizer, heldout)
    offsets = np.random.default_rng(seed).integers(0, stream.size - length - 1, count)
    return np.stack([stream[o : o + length + 1] for o in offsets])


def unigram_nll(tokenizer: Tokenizer, windows: np.ndarray) -> float:
    """Mean NLL of the windows' targets under add-one-smoothed token frequencies of the training files."""
    train, _ = corpus_files(Path(sysconfig.get_paths()["stdlib"]))
    counts = np.bincount(token_stream(tokenizer, train), minlength=tokenizer.get_vocab_size()) + 1.0
    log_p = np.log(counts / counts.sum())
    return float(-log_p[windows[:, 1:]].mean())


def scores(logits: np.ndarray, targets: np.ndarray) -> tuple[float, float]:
    """(mean negative log-likelihood, next-token accuracy) of float32 logits [b, t, v] for targets [b, t]."""
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -np.take_along_axis(np.asarray(log_probs), targets[..., None], -1)[..., 0]
    return float(nll.mean()), float((logits.argmax(-1) == targets).mean())


def decode_logits(model, windows: np.ndarray, schedule: dsv3.ExpertSchedule) -> np.ndarray:
    """Teacher-forced decoding: the logits of every position, each from one decode step over the cache."""
    cfg, w = model.config, model.weights
    inputs = windows[:, :-1]
    cache = dsv3.init_cache(cfg, len(inputs), inputs.shape[1], model.dtype, model.placement.device)
    first, cache = dsv3.prefill(cfg, w, inputs[:, :1], cache)
    step = jax.jit(dsv3.decode_step, static_argnums=(0, 5), donate_argnums=4)
    out = [np.asarray(first[:, 0])]
    for t in range(1, inputs.shape[1]):
        logits, cache = step(cfg, w, inputs[:, t], np.full(len(inputs), t, np.int32), cache, schedule)
        out.append(np.asarray(logits))
    return np.stack(out, axis=1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=default_model_dir())
    parser.add_argument("--windows", type=int, default=48)
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args(argv)

    start = time.perf_counter()
    base = hybridjit.load(args.model, dtype="float32")
    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    windows = heldout_windows(tokenizer, args.windows, args.length)
    targets = windows[:, 1:]
    k = base.config.num_experts_per_tok
    rows = [{"variant": "unigram baseline", "nll": unigram_nll(tokenizer, windows), "accuracy": None}]

    def add(variant, logits):
        nll, accuracy = scores(logits, targets)
        rows.append({"variant": variant, "nll": nll, "accuracy": accuracy})
        print(f"{variant:34s} perplexity {math.exp(nll):8.3f}  accuracy {accuracy:.4f}", flush=True)

    print(f"{args.windows} held-out windows of {args.length} tokens; unigram perplexity {math.exp(rows[0]['nll']):.3f}")
    add("bf16, whole-sequence logits", base.logits(windows[:, :-1]))
    add("bf16", decode_logits(base, windows, dsv3.ExpertSchedule()))
    for n in range(1, k):
        add(f"bf16, Expert Deferral {n}", decode_logits(base, windows, dsv3.ExpertSchedule(n_deferred=n)))
    for n in range(1, k):
        add(f"bf16, Expert Skipping {n}", decode_logits(base, windows, dsv3.ExpertSchedule(n_skipped=n)))
    base.close()
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"fp8 (block-scaled 128x128)": args.model.parent / (args.model.name + "-fp8")}
        for fmt in ("int8", "int4"):
            variants[f"{fmt} routed experts"] = convert_checkpoint(args.model, Path(tmp) / fmt, fmt)
        for variant, path in variants.items():
            model = hybridjit.load(path, dtype="float32")
            add(variant, decode_logits(model, windows, dsv3.ExpertSchedule()))
            model.close()
    reference = rows[2]["nll"]
    for row in rows:
        row["perplexity"] = round(math.exp(row["nll"]), 4)
        row["perplexity_delta_vs_bf16"] = round(math.exp(row["nll"]) - math.exp(reference), 4)
    print(json.dumps({"bench": "quality", "model": str(args.model), "windows": args.windows, "length": args.length,
                      "seconds": round(time.perf_counter() - start, 1), "results": rows}))


if __name__ == "__main__":
    main()
