"""The prefix cache: the KV of token prefixes already computed, kept in blocks of `block_tokens` positions and
evicted least-recently-used within a byte budget, so that a prompt sharing a prefix with earlier ones (a
multi-turn chat, an agent re-sending its history) computes only what follows the shared part.

A block is named by a digest of all the tokens up to its end (each block's digest chains its predecessor's),
so a block is found only after the same whole prefix: the KV of position i depends on every token before it.
Blocks hold one-row cache pytrees ([1, block_tokens, ...] per leaf) on the device where the cache lives, read
from caches that hold every position of every layer: a prompt's prefill cache (whose sliding-window layers are not
rings yet), or a decode slot of a model without rings (serving/scheduler.py keeps no blocks of a slot with rings,
whose windowed layers lost all but their last positions). A hit is written into such a prompt cache, so a ring
gets the window before the first computed token when the prompt is inserted.
"""

import collections
import hashlib
from collections.abc import Callable

import jax
import numpy as np


def _digest(previous: bytes, block: list[int]) -> bytes:
    return hashlib.blake2b(previous + np.asarray(block, np.int64).tobytes(), digest_size=16).digest()


class PrefixCache:
    def __init__(self, block_tokens: int, budget_bytes: int):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens, self.budget_bytes = block_tokens, budget_bytes
        self._blocks: collections.OrderedDict[bytes, tuple[list, int]] = collections.OrderedDict()
        self.bytes = 0
        self.hits = 0  # lookups that found at least one block
        self.hit_tokens = 0  # prompt tokens those lookups served

    def _digests(self, tokens: list[int], blocks: int) -> list[bytes]:
        digests, previous = [], b""
        for j in range(blocks):
            previous = _digest(previous, tokens[j * self.block_tokens : (j + 1) * self.block_tokens])
            digests.append(previous)
        return digests

    def lookup(self, tokens: list[int]) -> list[list]:
        """The cached blocks of the longest cached prefix of `tokens`, in order, leaving at least the last
        token to compute (its logits give the next token); marks them recently used."""
        found = []
        for digest in self._digests(tokens, (len(tokens) - 1) // self.block_tokens):
            if digest not in self._blocks:
                break
            self._blocks.move_to_end(digest)
            found.append(self._blocks[digest][0])
        if found:
            self.hits += 1
            self.hit_tokens += len(found) * self.block_tokens
        return found

    def store(self, tokens: list[int], read_block: Callable[[int], list]):
        """Keeps the whole blocks of `tokens` not yet cached; read_block(j) gives block j's cache (positions
        [j * block_tokens, (j + 1) * block_tokens)). Evicts the least recently used blocks past the budget."""
        for j, digest in enumerate(self._digests(tokens, len(tokens) // self.block_tokens)):
            if digest in self._blocks:
                self._blocks.move_to_end(digest)
                continue
            block = read_block(j)
            size = sum(leaf.nbytes for leaf in jax.tree.leaves(block))
            if size > self.budget_bytes:
                return
            self._blocks[digest] = (block, size)
            self.bytes += size
            while self.bytes > self.budget_bytes:
                _, (_, evicted) = self._blocks.popitem(last=False)
                self.bytes -= evicted

    def clear(self):
        self._blocks.clear()
        self.bytes = 0
