"""The embedded model's corpus: the Python standard library's own source, split by file into training and
held-out sets. Apart from the training code (and its optimiser dependency) so that evaluation
(bench/quality.py, the shipped-model tests) needs only the package's own dependencies.
"""

import hashlib
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
HELDOUT_EVERY = 20  # one file in 20 (by a hash of its path) is held out


def corpus_files(root: Path) -> tuple[list[Path], list[Path]]:
    """(training, held-out) .py files of the standard library, tests and vendored code excluded."""
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not ({"test", "tests", "idlelib", "site-packages", "lib2to3"} & set(p.relative_to(root).parts))
    )

    def held_out(p):
        return int(hashlib.sha256(str(p.relative_to(root)).encode()).hexdigest(), 16) % HELDOUT_EVERY == 0

    return [p for p in files if not held_out(p)], [p for p in files if held_out(p)]


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def token_stream(tok: Tokenizer, files: list[Path]) -> np.ndarray:
    """All files as one token array, each as BOS, its tokens, EOS."""
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    encoded = tok.encode_batch([read_text(f) for f in files])
    return np.concatenate([np.array([bos, *e.ids, eos], np.int32) for e in encoded])
