"""The decode engine: a fixed-shape decode state of `slots` sequences that requests join and leave between
steps, in the JetStream / jax-llm-examples `serving` style.

- `prefill` runs prompts (stream-loaded or hybrid, as the cost model chooses) into a cache of their own;
  `extend` continues a prompt whose first part is already in such a cache (a chunk of a chunked prefill, or
  the rest after a prefix-cache hit);
- `insert` copies a prefilled row into a free slot, with its position and sampling;
- `generate` dispatches the next decode steps of every slot (free slots compute harmlessly) and returns
  before the tokens exist, so the host's work on one call overlaps the device's on the next; a call runs
  `steps` steps in one program where launching a step costs the host more than the device takes to run it;
- `free` marks a slot free.

Every slot has its own position, sampling parameters and PRNG key: a sequence samples the same tokens
whichever slot it is in and whoever shares the step (token n of a sequence seeded s uses fold_in(key(s), n)).
Shapes are fixed by (slots, cache_len), and prompts are bucketed to powers of two, so requests joining and
leaving never recompile.
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from hybridjit.host_kv_cache import HostKVCache
from hybridjit.models.common.moe import MoE
from hybridjit.models.common.ring_cache import from_prompt, is_ring
from hybridjit.models.registry import family_of
from hybridjit.prefill_path import choose_prefill_path
from hybridjit.sampling import SamplingParams, restricts, sample
from hybridjit.stream_prefill import check_cpu_blocks, stream_decode_step, stream_prefill

MIN_BUCKET = 8
# The fewest cache positions a decode call attends over (span_of).
MIN_SPAN = 1024
# Decode steps per program call when the whole model is on the device. Its steps are so short that launching
# one costs the host more than the GPU takes to run it: XLA updates the step's CUDA graph for the new addresses of
# each call's buffers, which takes ~10 ms for a 48-layer Qwen3-30B-A3B step whose kernels run in ~5 ms (1x H100,
# bench/RESULTS.md). Looping on the device amortizes that over the steps of a call.
DEVICE_ONLY_DECODE_STEPS = 8
# Decode steps per call of a one-slot engine (a lone `generate`) whose routed experts run on the CPU behind the GPU
# hand-off: the per-call launch cost is a smaller share of such a step, but still ~0.18 ms a layer (Qwen3-235B-A22B
# FP8, 1x H100: 8.00 -> 7.31 ms a 4-layer step at 4 steps a call, bench/RESULTS.md). With more slots the engine keeps
# one step a call: dual-batch hides more, and a request arriving waits for the running call.
SINGLE_SLOT_HYBRID_DECODE_STEPS = 4


def bucket(n: int) -> int:
    """The padded length of n tokens: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << (n - 1).bit_length())


def _sample_rows(logits, keys, counts, temperature, top_k, top_p, restricted):
    """Each row of logits [b, vocab] sampled with its own key folded with its token count and its own
    parameters [b] (`restricted`: whether some row samples within top_k / top_p, sampling.sample's): (token ids [b],
    whether each row of logits is finite [b]). Checking finiteness next to sampling costs the host no extra wait."""

    tokens = sample(logits, jax.vmap(jax.random.fold_in)(keys, counts), temperature, top_k, top_p, restricted)
    return tokens, jnp.isfinite(logits).all(axis=-1)


@partial(jax.jit, static_argnums=(0, 9), donate_argnames="cache")
def _prefill_program(cfg, weights, tokens, lengths, cache, keys, temperature, top_k, top_p, restricted):
    logits, cache = family_of(cfg).model.prefill(cfg, weights, tokens, cache)
    last = logits[jnp.arange(tokens.shape[0]), lengths - 1]
    return _sample_rows(last, keys, jnp.zeros_like(lengths), temperature, top_k, top_p, restricted), cache


@partial(jax.jit, static_argnums=(0, 10), donate_argnames="cache")
def _extend_program(cfg, weights, tokens, starts, lengths, cache, keys, temperature, top_k, top_p, restricted):
    positions = starts[:, None] + jnp.arange(tokens.shape[1])
    logits, cache = family_of(cfg).model.extend(cfg, weights, tokens, positions, cache)
    last = logits[jnp.arange(tokens.shape[0]), jnp.clip(lengths - starts - 1, 0, tokens.shape[1] - 1)]
    return _sample_rows(last, keys, jnp.zeros_like(lengths), temperature, top_k, top_p, restricted), cache


_sample_program = jax.jit(_sample_rows, static_argnums=6)


def span_of(cache_len: int, last_position: int) -> int:
    """The cache positions a decode call attends over when no slot goes past `last_position`: a power of two from
    MIN_SPAN up (few compiled programs), at most cache_len."""
    return min(cache_len, max(MIN_SPAN, 1 << last_position.bit_length()))


def _within_span(span: int, caches, run):
    """run(caches) -> (out, caches) over only the first `span` positions of each cache leaf [b, L, ...]: attention
    then reads span positions, not L (a server's cache holds the whole context, a few of whose positions are in
    use); the span is written back in place (the caches are donated). A ring layer (a sliding window's) is read
    whole: it is small, and its positions are not in order."""
    if all(is_ring(node) or node.shape[1] == span for node in jax.tree.leaves(caches, is_leaf=is_ring)):
        return run(caches)
    out, views = run(jax.tree.map(lambda a: a if is_ring(a) else a[:, :span], caches, is_leaf=is_ring))

    def back(a, view):
        return view if is_ring(a) else jax.lax.dynamic_update_slice_in_dim(a, view, 0, axis=1)

    return out, jax.tree.map(back, caches, views, is_leaf=is_ring)


@partial(jax.jit, static_argnums=(0, 1, 2, 3), static_argnames=("restricted", "tally"), donate_argnames="cache")
def _decode_program(
    cfg, schedule, steps, span, weights, tokens, positions, live, cache, keys, counts, temperature, top_k, top_p,
    restricted, tally=False,
):
    """`steps` decode steps of one micro-batch from the last row of tokens [n, b], each step's tokens fed to the
    next, attending over the cache's first `span` positions: (((tokens, finite) [steps, b], with `tally` the
    experts each MoE layer chose for each slot's token [steps, moe layers, b, k] (-1: a free slot), else None),
    the cache)."""
    return _within_span(span, cache, partial(_decode_steps, cfg, schedule, steps, tally, weights, tokens, positions,
                                             live, keys, counts, temperature, top_k, top_p, restricted))


def _decode_steps(cfg, schedule, steps, tally, weights, tokens, positions, live, keys, counts, temperature, top_k,
                  top_p, restricted, cache):
    def step(i, tokens, cache):
        logits, cache, *tallied = family_of(cfg).model.decode_step(
            cfg, weights, tokens, positions + i, cache, schedule, live, tally
        )
        sampled = _sample_rows(logits, keys, counts + i, temperature, top_k, top_p, restricted)
        return sampled, cache, tallied[0] if tally else None

    if steps == 1:  # no loop around the custom calls of a hybrid step
        (new, finite), cache, tallied = step(0, tokens[-1], cache)
        return ((new[None], finite[None]), None if tallied is None else tallied[None]), cache

    def body(i, carry):
        last, out, finite, cache, routed = carry
        (new, ok), cache, tallied = step(i, last, cache)
        routed = None if routed is None else routed.at[i].set(tallied)
        return new, out.at[i].set(new), finite.at[i].set(ok), cache, routed

    b = tokens.shape[1]
    moe_layers = sum(isinstance(layer.mlp, MoE) for layer in weights.layers)
    routed = jnp.zeros((steps, moe_layers, b, cfg.num_experts_per_tok), jnp.int32) if tally else None
    init = (tokens[-1], jnp.zeros((steps, b), tokens.dtype), jnp.zeros((steps, b), bool), cache, routed)
    _, out, finite, cache, routed = jax.lax.fori_loop(0, steps, body, init)
    return ((out, finite), routed), cache


def _first(tallied: list):
    """The experts chosen [1, moe layers, b, k] that a decode step with `tally` returns after its logits and caches
    (a call's one step), or None without."""
    return tallied[0][None] if tallied else None


@partial(jax.jit, static_argnums=(0, 1, 2, 3), static_argnames=("restricted", "tally"), donate_argnames="caches")
def _decode_micro_batches_program(
    cfg, schedule, span, coalesced, weights, tokens, positions, live, caches, keys, counts, temperature, top_k, top_p,
    restricted, tally=False,
):
    """One decode step of several micro-batches: their routed experts coalesced into one call per layer
    (decode_step_grouped) or, two of them, overlapping each other's (decode_step_dual)."""
    model = family_of(cfg).model
    decode_step = model.decode_step_grouped if coalesced else model.decode_step_dual

    def run(caches):
        last = tuple(t[-1] for t in tokens)
        logits, caches, *tallied = decode_step(cfg, weights, last, positions, caches, schedule, live, tally)
        return (_sampled_rows(logits, keys, counts, temperature, top_k, top_p, restricted), _first(tallied)), caches

    return _within_span(span, caches, run)


def _sampled_rows(logits, keys, counts, temperature, top_k, top_p, restricted) -> tuple:
    """Each micro-batch's logits sampled as one step: ((tokens, finite) [1, b_g], ...)."""
    per_batch = zip(logits, keys, counts, temperature, top_k, top_p, strict=True)
    sampled = (_sample_rows(*args, restricted) for args in per_batch)
    return tuple((tokens[None], finite[None]) for tokens, finite in sampled)


@partial(jax.jit, donate_argnames="cache")
def _insert_program(cache, rows, row, length, slot):
    """cache [slots, L, ...] with row `row` of rows [b, t <= L, ...] (a prompt cache, without rings) copied to
    positions [0, t) of slot `slot`; a ring layer of the slot gets the positions before `length` that it keeps."""

    def put_layer(big, small):
        ones = [jax.lax.dynamic_slice_in_dim(a, row, 1, axis=0) for a in jax.tree.leaves(small)]
        if is_ring(big):
            ones = [from_prompt(a, length[None], b.shape[1]) for a, b in zip(ones, jax.tree.leaves(big), strict=True)]
        put = [
            jax.lax.dynamic_update_slice(b, a.astype(b.dtype), (slot,) + (0,) * (b.ndim - 1))
            for a, b in zip(ones, jax.tree.leaves(big), strict=True)
        ]
        return jax.tree.unflatten(jax.tree.structure(big), put)

    return [put_layer(big, small) for big, small in zip(cache, rows, strict=True)]


@partial(jax.jit, static_argnums=2)
def _read_span(cache, slot, length, start):
    """Positions [start, start + length) of one slot of cache: each leaf [1, length, ...]."""
    return jax.tree.map(
        lambda a: jax.lax.dynamic_slice(a, (slot, start) + (0,) * (a.ndim - 2), (1, length) + a.shape[2:]), cache
    )


@partial(jax.jit, donate_argnames="cache")
def _write_span(cache, span, slot, start):
    """cache with `span` (each leaf [1, n, ...]) written to positions [start, start + n) of slot `slot`."""
    return jax.tree.map(
        lambda a, s: jax.lax.dynamic_update_slice(a, s.astype(a.dtype), (slot, start) + (0,) * (a.ndim - 2)),
        cache,
        span,
    )


@dataclasses.dataclass
class Prefilled:
    """Prompts whose caches are filled: rows [b, t] of their own cache, the first new token of each [b] and
    whether its logits were finite [b] (device arrays, not waited on), and the prompt lengths [b]."""

    cache: list
    tokens: jax.Array
    finite: jax.Array
    lengths: np.ndarray


@dataclasses.dataclass
class Step:
    """One dispatched call of decode steps: the new tokens of every slot [steps, slots] and whether their logits
    were finite, once the device has them (reading them waits); with an engine that tallies, the routed experts
    the occupied slots' tokens chose."""

    _sampled: list
    _routed: jax.Array | None = None

    def routed_experts(self) -> np.ndarray | None:
        """The experts each MoE layer chose for each slot's token at each step of the call, int32 [steps, moe layers,
        slots, k], -1 for a free slot (None: the engine does not tally)."""
        return None if self._routed is None else np.asarray(self._routed)

    def tokens(self) -> np.ndarray:
        return np.concatenate([np.asarray(t) for t, _ in self._sampled], axis=1)

    def finite(self) -> np.ndarray:
        return np.concatenate([np.asarray(f) for _, f in self._sampled], axis=1)


def sampling_arrays(params: list[SamplingParams]) -> tuple:
    """Per-row arguments of the programs: (keys [b], temperature [b], top_k [b], top_p [b]) on the device, and
    whether some row restricts (the programs' static `restricted`)."""
    args = [p.device_args() for p in params]
    keys = jnp.stack([p.key() for p in params])
    temperature, top_k, top_p = (jnp.stack(column) for column in zip(*args, strict=True))
    restricted = any(restricts(p.temperature, p.top_k, p.top_p) for p in params)
    return keys, temperature, top_k, top_p, restricted


class Engine:
    """The decode state of `slots` sequences over `model` (a hybridjit.engine.Model), each with room for
    cache_len positions, in micro-batches of consecutive slots (each with a cache of its own):

    - micro_batches=None (interactive): with model.dual_batch, two or more slots and routed experts computed
      on the CPU, two micro-batches that decode interleaved, each with its own routed-expert calls
      (decode_step_dual), so that one's GPU work hides the other's CPU experts; else one;
    - micro_batches=n (offline throughput): n micro-batches whose attention runs one after the other and whose
      routed experts run as one call per layer over all of them (decode_step_grouped, module-based batching).

    With stream_experts (offline throughput, large batches), each decode step streams the routed experts to the device
    from their pinned host copy, as stream-loaded prefill does (stream_prefill.stream_decode_step): one micro-batch,
    one step a call, attending over the whole cache; its generate returns once the step has run (the step is a host
    loop over per-layer executables). With `cpu_blocks` as well, the last that many expert blocks of each layer stay
    on the CPU, whose kernels compute them while the rest streams (co-execution). With `kv_in_host` as well, the
    cache is held in pinned host memory (host_kv_cache.HostKVCache) and copied to the device a layer at a time:
    the slots are then bounded by host memory, not the device's; with `attention_on_cpu` too, the CPU attends over it
    where it is, and only the experts cross the link.

    Each generate call runs `steps` decode steps: model.decode_steps if set (the interactive engine then decodes
    one micro-batch), else DEVICE_ONLY_DECODE_STEPS when the whole model runs on a GPU (no routed expert on the
    CPU), SINGLE_SLOT_HYBRID_DECODE_STEPS for one slot on a GPU with experts on the CPU, else 1. A slot's tokens
    past its stop, or from steps past the end of its cache, are garbage the caller drops.

    A sliding-window layer whose window is shorter than cache_len keeps only its window per slot, as a ring
    (models/common/ring_cache.py): prompts are prefilled into caches of every position, and insert copies the
    window before the prompt's end into the ring; decode calls read a ring whole and full layers over their span.
    """

    def __init__(self, model, slots: int, cache_len: int, micro_batches: int | None = None, tally: bool = False,
                 stream_experts: bool = False, cpu_blocks: int = 0, kv_in_host: bool = False,
                 attention_on_cpu: bool = False):  # fmt: skip
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if not 1 <= cache_len <= model.config.max_position_embeddings:
            raise ValueError(f"cache_len must be in [1, {model.config.max_position_embeddings}], got {cache_len}")
        if micro_batches is not None and not 1 <= micro_batches <= slots:
            raise ValueError(f"micro_batches must be in [1, slots = {slots}], got {micro_batches}")
        self.model, self.slots, self.cache_len = model, slots, cache_len
        self.tally = tally  # each Step also gives the routed experts its tokens chose (Step.routed_experts)
        self.coalesced = micro_batches is not None
        on_host = model.experts_on_host
        interactive_on_gpu = micro_batches is None and model.placement.device.platform == "gpu"
        if model.decode_steps is not None and not (isinstance(model.decode_steps, int) and model.decode_steps >= 1):
            raise ValueError(f"decode_steps must be an integer >= 1 or None, got {model.decode_steps!r}")
        if model.decode_steps:
            self.steps = model.decode_steps
        elif interactive_on_gpu and not on_host:
            self.steps = DEVICE_ONLY_DECODE_STEPS
        elif interactive_on_gpu and slots == 1:
            self.steps = SINGLE_SLOT_HYBRID_DECODE_STEPS
        else:
            self.steps = 1
        self.stream_experts, self.cpu_blocks = stream_experts, cpu_blocks
        if cpu_blocks and not stream_experts:
            raise ValueError(f"cpu_blocks={cpu_blocks}: the CPU takes blocks of a streamed step; set stream_experts")
        if cpu_blocks:
            check_cpu_blocks(model, cpu_blocks)
        if kv_in_host and not stream_experts:
            raise ValueError("kv_in_host: a cache in host memory is read by streamed decode steps; set stream_experts")
        if attention_on_cpu and not kv_in_host:
            raise ValueError("attention_on_cpu: the CPU attends over a cache in host memory; set kv_in_host")
        self.kv_in_host, self.attention_on_cpu = kv_in_host, attention_on_cpu
        if stream_experts:
            if choose_prefill_path(model, 1, 1, threshold=0) != "stream":
                raise ValueError("stream_experts: the model's routed experts are not pinned for streaming; load it "
                                 "with Placement(pinned_experts=True)")  # fmt: skip
            if micro_batches not in (None, 1) or tally or model.decode_steps not in (None, 1):
                raise ValueError("stream_experts: decodes one micro-batch, one step a call, without tally")
            if model.expert_schedule.n_skipped or model.expert_schedule.n_deferred:
                raise ValueError("stream_experts: streams every routed expert; turn Expert Deferral and Skipping off")
            self.steps, micro_batches = 1, 1
        if micro_batches is None:
            micro_batches = 2 if model.dual_batch and slots > 1 and on_host and self.steps == 1 else 1
        if self.steps > 1 and micro_batches > 1:
            raise ValueError(f"decode_steps = {self.steps} needs one micro-batch, got micro_batches = {micro_batches}")
        bounds = [slots * m // micro_batches for m in range(micro_batches + 1)]
        # The larger micro-batches first, as dual-batch has always split (its first half takes the odd slot).
        bounds = [slots - b for b in reversed(bounds)]
        self.groups = [range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        self.reset()

    def reset(self):
        """Every slot free, the cache zeroed: also the way back after a step failed (its donated cache is gone)."""
        m = self.model
        init = partial(m.family.model.init_cache, ring=True)
        if self.kv_in_host:  # pinned once: allocating and pinning host memory takes far longer than zeroing it
            host = getattr(self, "caches", None)
            if host is None:
                host = [HostKVCache(m, self.slots, self.cache_len, self.attention_on_cpu)]
            host[0].clear()
            self.caches = host
        else:
            self.caches = [init(m.config, len(g), self.cache_len, m.dtype, m.placement.device) for g in self.groups]
        # Whether some layer keeps only its window (a ring), so that a slot no longer holds all its positions.
        self.has_rings = not self.kv_in_host and any(is_ring(layer) for layer in self.caches[0])
        # Per micro-batch, the tokens [steps, b] of the last call, whose last row the next call decodes from:
        self.tokens = [jnp.zeros((self.steps, len(g)), jnp.int32) for g in self.groups]
        self.positions = np.zeros(self.slots, np.int32)
        self.counts = np.zeros(self.slots, np.int32)  # tokens each slot's sequence has sampled
        greedy = SamplingParams()
        self.keys = [jnp.stack([greedy.key()] * len(g)) for g in self.groups]  # per micro-batch, as steps take them
        self.temperature = np.zeros(self.slots, np.float32)
        self.top_k = np.zeros(self.slots, np.int32)
        self.top_p = np.ones(self.slots, np.float32)
        self.occupied = np.zeros(self.slots, bool)

    def _where(self, slot: int) -> tuple[int, int]:
        """(micro-batch, row in it) of a slot."""
        for g, rows in enumerate(self.groups):
            if slot in rows:
                return g, slot - rows.start
        raise IndexError(f"slot {slot} outside [0, {self.slots})")

    def free_slots(self) -> list[int]:
        return [int(s) for s in np.flatnonzero(~self.occupied)]

    # ------------------------------------------------------------------------------------- prefill

    def prefill(self, seqs: list[list[int]], params: list[SamplingParams]) -> Prefilled:
        """Whole prompts from position 0, right-padded to a bucket: stream-loaded or hybrid prefill as
        prefill_path.choose_prefill_path decides for the model."""
        m = self.model
        lengths = np.array([len(s) for s in seqs], np.int32)
        if (longest := int(lengths.max())) > self.cache_len:
            raise ValueError(f"seqs: a prompt of {longest} tokens does not fit slots of {self.cache_len} positions")
        width = min(bucket(longest), self.cache_len)
        tokens = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = s
        cache = m.family.model.init_cache(m.config, len(seqs), width, m.dtype, m.placement.device)
        keys, *sampling = sampling_arrays(params)
        if choose_prefill_path(m, *tokens.shape, threshold=m.stream_prefill_threshold) == "stream":
            logits, cache = stream_prefill(m, tokens, lengths, cache)
            first, finite = _sample_program(logits, keys, jnp.zeros(len(seqs), jnp.int32), *sampling)
        else:
            (first, finite), cache = _prefill_program(m.config, m.weights, tokens, lengths, cache, keys, *sampling)
        return Prefilled(cache, first, finite, lengths)

    def new_prompt_cache(self, length: int, device: jax.Device | None = None) -> list:
        """An empty cache of one row with room for a prompt of `length` tokens (bucketed), for extend; on `device`
        (default: the placement's)."""
        m = self.model
        width = min(bucket(length), self.cache_len)
        return m.family.model.init_cache(m.config, 1, width, m.dtype, device or m.placement.device)

    def extend(self, cache: list, tokens: list[int], start: int, params: SamplingParams, chunk: int) -> Prefilled:
        """One row's prompt tokens at positions [start, start + len(tokens)) added to `cache` (donated),
        which holds the positions before start: the prompt's sampled next token, as prefill gives it. The
        tokens run padded to `chunk` (a bucket), so that every chunk of every prompt shares one program."""
        m = self.model
        padded = np.zeros((1, chunk), np.int32)
        padded[0, : len(tokens)] = tokens
        keys, *sampling = sampling_arrays([params])
        end = np.array([start + len(tokens)], np.int32)
        (first, finite), cache = _extend_program(
            m.config, m.weights, padded, np.array([start], np.int32), end, cache, keys, *sampling
        )
        return Prefilled(cache, first, finite, end)

    # -------------------------------------------------------------------------------------- slots

    def insert(self, prefilled: Prefilled, row: int, slot: int, params: SamplingParams):
        """Row `row` of `prefilled` into slot `slot`: its cache, its first token (to be fed to the next
        step), its position and its sampling."""
        if self.occupied[slot]:
            raise ValueError(f"slot {slot} is occupied")
        if (width := jax.tree.leaves(prefilled.cache)[0].shape[1]) > self.cache_len:
            raise ValueError(f"a prefilled cache of {width} positions does not fit slots of {self.cache_len}")
        g, r = self._where(slot)
        if self.kv_in_host:
            self.caches[g].insert(prefilled.cache, row, int(prefilled.lengths[row]), r)
        else:
            self.caches[g] = _insert_program(self.caches[g], prefilled.cache, row, prefilled.lengths[row], r)
        self.tokens[g] = self.tokens[g].at[-1, r].set(prefilled.tokens[row])
        self.positions[slot] = prefilled.lengths[row]
        self.counts[slot] = 1  # the first token, sampled by prefill
        self.keys[g] = self.keys[g].at[r].set(params.key())
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = map(np.asarray, params.device_args())
        self.occupied[slot] = True

    def free(self, slot: int):
        self.occupied[slot] = False
        self.positions[slot] = 0
        # Greedy, so that a free slot never makes a step sort for top_k / top_p (sampling.sample's `restricted`).
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = 0.0, 0, 1.0

    def read_span(self, slot: int, start: int, length: int) -> list:
        """Cache positions [start, start + length) of a slot, a one-row cache pytree (for the prefix cache). Not
        with rings: a ring layer of a slot keeps only its last positions."""
        if self.has_rings:
            raise ValueError(f"slot: slot {slot} keeps only the windows of its sliding-window layers")
        if self.kv_in_host:
            raise ValueError("read_span: this engine's cache is in host memory, for streamed offline decoding")
        g, r = self._where(slot)
        return _read_span(self.caches[g], r, length, start)

    @staticmethod
    def prompt_span(cache: list, start: int, length: int) -> list:
        """Positions [start, start + length) of a one-row prompt cache (new_prompt_cache, Prefilled.cache)."""
        return _read_span(cache, 0, length, start)

    @staticmethod
    def write_span(cache: list, span: list, start: int) -> list:
        """A one-row prompt cache (donated) with `span` written from position `start`."""
        return _write_span(cache, span, 0, start)

    @staticmethod
    def sample(logits: jax.Array, params: SamplingParams) -> tuple[jax.Array, jax.Array]:
        """The first tokens [b] of prompts whose last logits [b, vocab] are given (stream-loaded prefill's), and
        whether each row is finite."""
        keys, *sampling = sampling_arrays([params] * logits.shape[0])
        return _sample_program(logits, keys, jnp.zeros(logits.shape[0], jnp.int32), *sampling)

    # ----------------------------------------------------------------------------------- decoding

    def generate(self) -> Step:
        """Dispatches the next `steps` decode steps of every slot and advances the occupied slots' positions;
        returns at once. Free slots compute garbage but run no routed experts. The call after the one that gives
        a request its last token may run before that token is read (it is garbage for that slot): so a call may
        start at most steps - 1 positions after the cache's last one, and a slot further on must be freed first."""
        if (self.positions[self.occupied] >= self.cache_len + self.steps - 1).any():
            raise ValueError(f"a slot is past the end of its {self.cache_len} cache positions")
        m, schedule = self.model, self.model.expert_schedule
        last = int(self.positions[self.occupied].max(initial=0)) + self.steps - 1
        span = span_of(self.cache_len, last)
        split = [
            # Copies: the host arrays change while the step may still be reading its arguments.
            tuple(
                a[g.start : g.stop].copy()
                for a in (self.positions, self.occupied, self.counts, self.temperature, self.top_k, self.top_p)
            )
            for g in self.groups
        ]
        # Sorted for top_k / top_p only in a step where some slot asks for it (free slots are greedy).
        restricted = restricts(self.temperature, self.top_k, self.top_p)
        if self.stream_experts:
            (positions, live, counts, temperature, top_k, top_p), = split
            logits, cache = stream_decode_step(m, self.tokens[0][-1], positions, live, self.caches[0],
                                               cpu_blocks=self.cpu_blocks)
            new, finite = _sample_program(logits, self.keys[0], counts, temperature, top_k, top_p, restricted)
            sampled, routed, self.caches = ((new[None], finite[None]),), None, [cache]
        elif len(self.groups) > 1:
            positions, live, counts, temperature, top_k, top_p = zip(*split, strict=True)
            (sampled, routed), caches = _decode_micro_batches_program(
                m.config, schedule, span, self.coalesced, m.weights, tuple(self.tokens), positions, live,
                tuple(self.caches), tuple(self.keys), counts, temperature, top_k, top_p, restricted=restricted,
                tally=self.tally,
            )
            self.caches = list(caches)
        else:
            (positions, live, counts, temperature, top_k, top_p), = split
            (sampled, routed), cache = _decode_program(
                m.config, schedule, self.steps, span, m.weights, self.tokens[0], positions, live, self.caches[0],
                self.keys[0], counts, temperature, top_k, top_p, restricted=restricted, tally=self.tally,
            )
            sampled, self.caches = (sampled,), [cache]
        self.tokens = [tokens for tokens, _ in sampled]
        self.positions[self.occupied] += self.steps
        self.counts[self.occupied] += self.steps
        return Step(list(sampled), routed)
