"""`hybridjit.load(...)` and the Model it returns: logits, generate and stream over the jitted programs.

The programs are module-level jitted functions of (config, weights, ...): the config is static, the
weights are arguments (never baked-in constants) and the KV cache is donated so each decode step updates
it in place. Shapes are bucketed (powers of two) so a handful of programs serve every request.
"""

import dataclasses
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybridjit import expert_residency, machine_floors
from hybridjit.auto_placement import DeviceBudget, device_budget, resident_expert_bytes
from hybridjit.expert_residency import Residency
from hybridjit.model_files import open_checkpoint, open_tokenizer
from hybridjit.models.common.moe import ExpertSchedule, MoE
from hybridjit.models.common.resident_experts import ResidentExperts
from hybridjit.models.registry import ModelConfig, family_of
from hybridjit.ops.async_experts import raise_gpu_errors
from hybridjit.pinned_experts import default_block_experts, pinned_layer, size_host_memory_pool
from hybridjit.placement import Placement, compute_dtype, prefill_mesh
from hybridjit.prefill_path import PrefillRates
from hybridjit.resolve import resolve_model
from hybridjit.sampling import SamplingParams, integer, is_integer
from hybridjit.serving.engine import Engine, bucket
from hybridjit.tokenizer import IncrementalDecoder, first_stop, no_tokenizer
from hybridjit.weights import Progress, WeightLoader, routed_expert_bytes


class NonFiniteLogitsError(ValueError):
    """Logits with NaN or infinity: the weights are corrupt, or config.json holds values that break the math.
    Raised instead of returning tokens (a row of NaN logits would sample token 0 every step)."""


@partial(jax.jit, static_argnums=0)
def _logits_program(cfg, weights, tokens):
    logits = family_of(cfg).model.prefill(cfg, weights, tokens)[0]
    return logits, jnp.isfinite(logits).all(axis=-1)


@partial(jax.jit, static_argnums=0)
def _finite_stages_program(cfg, weights, tokens):
    return family_of(cfg).model.finite_stages(cfg, weights, tokens)


def _right_padded(seqs: list[list[int]], width: int) -> np.ndarray:
    tokens = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    return tokens


class Model:
    """A loaded checkpoint. `weights` and `config` compose with the functions of its family
    (`family`: hybridjit.models.<family>, e.g. deepseek_v3)."""

    def __init__(
        self, path: Path, config: ModelConfig, weights, expert_layers, tokenizer, placement: Placement,
        loader: WeightLoader | None = None,
    ):
        self.path, self.config, self.weights = path, config, weights
        self.expert_layers = expert_layers  # keeps the C++ bank's layers registered while the model lives
        self.tokenizer, self.placement = tokenizer, placement
        self._loader = loader  # reads experts again from the checkpoint for their resident copies
        self.device_budget: DeviceBudget | None = None  # what the last automatic residency had to spend
        # Decode-time settings, changeable between requests:
        self.dual_batch = True  # with experts on the CPU, two or more sequences decode as two micro-batches
        # Decode steps a program call runs; None: serving.engine.Engine's choice (several only when every routed
        # expert is on the device, where launching a step costs the host more than running it costs the GPU).
        self.decode_steps: int | None = None
        # Prompt tokens (batch x length) from which prefill streams the experts to the GPU instead of
        # running them on the CPU; None: decided by the cost model (prefill_path.choose_prefill_path).
        self.stream_prefill_threshold: int | None = None
        self.expert_schedule = ExpertSchedule()  # Expert Deferral / Skipping: off (they change the model)
        self._prefill_weights = None  # prefill_weights' copy over several devices, made at its first call

    @property
    def family(self):
        """The model family package (hybridjit.models.<family>) whose functions the programs run."""
        return family_of(self.config)

    @property
    def dtype(self):
        return self.placement.dtype

    def close(self):
        for layer in self.expert_layers:
            layer.close()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def prefill_rates(self) -> PrefillRates:
        """The rates the prefill-path choice reads, of this machine (hybridjit.machine_floors: measured the first
        time, then cached): pinned host -> device copies, the GPU's GEMM rate, and the CPU kernels' rate on this
        model's routed experts (their format and shapes)."""
        floors = machine_floors.FloorCache().floors(self.placement.device)
        if floors.pcie_gbps is None or not self.expert_layers:  # no accelerator, or no expert on the CPU
            return PrefillRates()
        return PrefillRates(floors.pcie_gbps, floors.gpu_tflops, self.cpu_expert_tflops())

    def cpu_expert_tflops(self, tokens: int = machine_floors.CPU_EXPERT_TOKENS, threads: int | None = None,
                          co_executed: bool = False) -> float:  # fmt: skip
        """The CPU kernels' rate on this model's routed experts (their format and shapes) in a call of `tokens`
        tokens routed uniformly, on this machine (hybridjit.machine_floors: measured the first time, then cached).
        It falls steeply with the tokens per expert: the offline policy reads it at several batch sizes. On a pool
        of `threads` (default: as configured), and, `co_executed`, as a co-executed streamed step's CPU share: one
        block's experts weighted (pinned_experts.default_block_experts), while the link copies to the device back to
        back. Few experts a call run below the whole layer's rate: on a 16-core Xeon, 12 threads, one of Mixtral's 8
        at 0.81 of it and a 16-expert block of Qwen3's 128 at 0.82 (bench/RESULTS.md, session 35; 0.55 and 0.84
        before its AMX packs)."""
        layer, k = self.expert_layers[0], self.config.num_experts_per_tok
        key = f"{layer.format} experts {layer.hidden}x{layer.inter}, {k} of {layer.n_experts} a token"
        if tokens != machine_floors.CPU_EXPERT_TOKENS:  # the prefill-path choice's rate keeps its key
            key += f", {tokens} tokens a call"
        if threads is not None:
            key += f", {threads} threads"
        if co_executed:
            key += ", one block's experts, the link copying"
        device = self.placement.device
        return machine_floors.FloorCache().cpu_expert_tflops(device, key, lambda: machine_floors.cpu_expert_tflops(
            layer.id, layer.hidden, layer.inter, layer.n_experts, k, tokens, threads=threads,
            copying_to=device if co_executed else None,
            weighted=default_block_experts(layer.n_experts) if co_executed else None))  # fmt: skip

    def prefill_weights(self, devices: tuple[jax.Device, ...] | None = None):
        """The weights stream-loaded prefill runs on over `devices` (default Placement.stream_devices). On the
        placement's device alone, `weights`; else copies replicated on each of them, resident experts left out (the
        prefill streams every routed expert): made once for all the stream devices at the first call and kept while
        the model lives, a subset of them taking its devices' copies."""
        everywhere = self.placement.stream_devices
        devices = devices or everywhere
        if not set(devices) <= set(everywhere):
            raise ValueError(f"devices: {devices} are not among the placement's prefill devices {everywhere}")
        if devices == (self.placement.device,):
            return self.weights
        if self._prefill_weights is None:
            layers = [dataclasses.replace(layer, mlp=dataclasses.replace(layer.mlp, resident=None))
                      if isinstance(layer.mlp, MoE) else layer for layer in self.weights.layers]
            streamed = dataclasses.replace(self.weights, layers=layers)
            self._prefill_weights = jax.device_put(streamed, NamedSharding(self.placement.prefill_mesh, P()))
        if devices == everywhere:
            return self._prefill_weights
        mesh = prefill_mesh(devices)

        def on_devices(a):
            shards = {s.device: s.data for s in a.addressable_shards}
            return jax.make_array_from_single_device_arrays(a.shape, NamedSharding(mesh, P()),
                                                            [shards[d] for d in devices])

        return jax.tree.map(on_devices, self._prefill_weights)

    # ----------------------------------------------------------------------------- residency

    @property
    def residency(self) -> Residency:
        """The routed experts each MoE layer holds on the device (hybridjit.expert_residency)."""
        return expert_residency.current(self.weights)

    @property
    def experts_on_host(self) -> bool:
        """Whether some routed experts are computed on the CPU: held in host memory and not resident on the device."""
        resident = self.residency.layers
        return any(len(resident.get(i, ())) < n for i, n in expert_residency.bank_moe_layers(self.weights).items())

    def probe(self, prompts, batch: int = 8) -> dict[int, np.ndarray]:
        """Layer -> activations per routed expert over `prompts` (texts or token-id lists, as generate takes),
        prefilled in batches: the sample a residency is chosen from (place_experts' `counts`)."""
        seqs, _ = self._encode(prompts)
        return expert_residency.count_activations(self, seqs, batch)

    def place_experts(self, residency="auto", counts: dict[int, np.ndarray] | None = None, **budget) -> Residency:
        """Holds routed experts on the device as `residency` says: "auto" (each MoE layer's most activated experts
        in `counts`, else its first ones, as many as device_budget allows with `budget`'s overrides, e.g.
        kv_tokens), a Residency, or the path of one saved as JSON. Between requests only: a layer that keeps its
        number of resident experts has just the changed ones copied. Returns the residency now held."""
        if self._loader is None or not self._loader.expert_names:
            raise ValueError(f"{self.path}: this model has no routed experts in host memory to place on the device")
        self.hold_resident_experts(widened=False)  # a swap writes copies as stored into the stacks
        source = "residency"
        if isinstance(residency, str | Path) and residency != "auto":
            source, residency = str(residency), Residency.load(residency)
        held = self.residency.experts * resident_expert_bytes(self.config, self.dtype)
        plan = device_budget(self.config, self.placement.device, self.dtype,
                             moe_layers=len(self._loader.expert_names), **budget)
        if "free_bytes" not in budget:  # the copies held now are given back as they are replaced
            plan = dataclasses.replace(plan, free_after_weights=plan.free_after_weights + held)
        if residency == "auto":
            unused = np.zeros(self.config.n_routed_experts)
            residency = Residency.most_used(
                {layer: (counts or {}).get(layer, unused) for layer in self._loader.expert_names},
                plan.resident_per_layer,
            )
            self.device_budget = plan
        elif not isinstance(residency, Residency):
            raise TypeError(f"residency must be 'auto', a Residency or a path, got {residency!r:.60}")
        residency.check(expert_residency.bank_moe_layers(self.weights), source)
        plan.check(residency.experts)
        self.weights = expert_residency.apply(self.weights, residency, self.resident_copies)
        return residency

    def hold_resident_experts(self, widened: bool) -> None:
        """Holds the device copies of FP8 routed experts dequantized in the compute dtype (`widened`: an offline
        batch's grouped steps then skip dequantizing every copy each step, at twice the copies' device bytes) or
        as stored (FP8 with block scales, made again from the pinned host copy or the checkpoint), one layer at a
        time. Copies of other formats are always held in the compute dtype."""
        def build(layer: int, res: ResidentExperts) -> ResidentExperts:
            if widened:
                return expert_residency.widened_copies(res, self.dtype)
            return self.resident_copies(layer, expert_residency.current_ids(res)) if res.widened else res

        for layer in expert_residency.resident_layers(self.weights):  # each layer's copies valid whatever fails
            self.weights = expert_residency.rebuilt_layer(self.weights, layer, build)

    @property
    def resident_widened(self) -> bool:
        """Whether resident copies of FP8 experts are held dequantized (hold_resident_experts)."""
        return any(self.weights.layers[i].mlp.resident.widened for i in expert_residency.resident_layers(self.weights))

    def resident_copies(self, layer: int, ids) -> ResidentExperts | None:
        """Device copies of experts `ids` of MoE layer `layer` (what place_experts holds and swap_experts takes
        in): from the pinned host copy where the experts have one (pinned_experts.PinnedExperts.resident), else
        read from the checkpoint again."""
        if self._loader is None or layer not in self._loader.expert_names:
            raise ValueError(f"{self.path}: layer {layer} has no routed experts in host memory")
        pinned = pinned_layer(self.weights.layers[layer].mlp.expert_layer)
        if pinned is not None:
            return pinned.resident(ids, self.dtype, self.placement.device)
        return self._loader.resident_experts(self._loader.expert_names[layer], ids)

    def swap_experts(self, residency: Residency, copies: dict[int, list[ResidentExperts]]) -> None:
        """Holds `residency`, which keeps as many experts on the device in every layer as are there now, with
        copies[layer] (resident_copies) holding the experts each changed layer takes in: re-placement while
        serving (serving/online_placement.py), between decode steps. The copies take the slots of the experts that
        leave, so it needs no device memory beyond them and the compiled steps stay the same."""
        if self.resident_widened:
            raise ValueError("the resident copies are held dequantized (hold_resident_experts): a swap writes copies "
                             "as stored; hold them as stored first")  # fmt: skip
        before = self.residency.layers
        for layer, ids in residency.layers.items():
            incoming = tuple(sorted(set(ids) - set(before.get(layer, ()))))
            brought = tuple(sorted(i for copy in copies.get(layer, []) for i in expert_residency.current_ids(copy)))
            if len(ids) != len(before.get(layer, ())) or brought != incoming:
                raise ValueError(f"layer {layer}: a swap keeps the number of resident experts and brings copies of "
                                 f"exactly the experts it takes in ({incoming}), got {len(ids)} experts and copies "
                                 f"of {brought}")
        self.weights = expert_residency.apply(self.weights, residency, lambda layer, ids: copies[layer])

    # ---------------------------------------------------------------------------------- inputs

    def _check_ids(self, sequences) -> list[list[int]]:
        """Token-id sequences (lists or arrays of integers) as lists, each checked against the vocabulary."""
        if not _is_array_like(sequences):
            raise TypeError(f"token_ids must be a list of token-id lists, got {sequences!r:.60}")
        if not len(sequences):
            raise ValueError("token_ids is empty")
        return [self._token_ids(i, seq) for i, seq in enumerate(sequences)]

    def _token_ids(self, i: int, seq) -> list[int]:
        if not _is_array_like(seq):
            raise TypeError(f"sequence {i} must be a list of token ids, got {seq!r:.60}")
        if isinstance(seq, np.ndarray | jax.Array):
            if seq.ndim != 1 or seq.dtype.kind not in "iu":
                raise TypeError(f"sequence {i} must hold token ids (integers), got an array {seq.dtype}{seq.shape}")
        elif bad := [t for t in seq if not is_integer(t)]:
            raise TypeError(f"sequence {i} must hold token ids (integers), got {bad[0]!r}")
        seq = [int(t) for t in seq]
        if not seq:
            raise ValueError(f"sequence {i} is empty")
        bad = [t for t in seq if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"sequence {i}: token id {bad[0]} outside the vocabulary [0, {self.config.vocab_size})")
        return seq

    def _encode(self, prompt) -> tuple[list[list[int]], str]:
        """Normalises a prompt to token-id lists and says what shape the answer takes."""
        if isinstance(prompt, str):
            return [self._tokenize(prompt)], "text"
        if isinstance(prompt, bytes | bytearray):
            raise TypeError("prompt is bytes: decode it to a str (prompt.decode()) or pass a list of token ids")
        if not _is_array_like(prompt):
            raise TypeError(f"prompt must be {PROMPT_KINDS}, got {prompt!r:.60}")
        if isinstance(prompt, jax.Array):
            prompt = np.asarray(prompt)  # whose items are numpy scalars or rows, not 0-d JAX arrays
        if not len(prompt):
            raise ValueError(f"prompt is empty: pass {PROMPT_KINDS}")
        if all(isinstance(p, str) for p in prompt):
            return [self._tokenize(p) for p in prompt], "texts"
        if any(_is_array_like(p) for p in prompt):
            return self._check_ids(prompt), "id_lists"
        return self._check_ids([prompt]), "ids"

    def _tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{no_tokenizer(self.path)}: pass token ids instead of text")
        try:
            ids = self.tokenizer.encode(text)
        except ValueError as e:
            raise ValueError(f"prompt: {e}") from None
        return self._check_ids([ids])[0]

    # ------------------------------------------------------------------------------- research

    def logits(self, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """float32 logits [batch, max_len, vocab] of whole sequences (right-padded; padding rows unspecified)."""
        seqs = self._check_ids(token_ids)
        self._check_context(seqs)
        longest = max(len(s) for s in seqs)
        tokens = _right_padded(seqs, bucket(longest))
        logits, finite = _logits_program(self.config, self.weights, tokens)
        logits, finite = np.asarray(logits)[:, :longest], np.asarray(finite)
        raise_gpu_errors()
        for i, seq in enumerate(seqs):
            if not finite[i, : len(seq)].all():
                position = int(np.argmin(finite[i]))
                raise self._non_finite(seq[: position + 1], f"sequence {i} at position {position}")
        return logits

    def _check_context(self, seqs: list[list[int]], max_new_tokens: int = 0):
        """Raises when the longest sequence, plus the max_new_tokens to generate after it, exceeds the context."""
        row = max(range(len(seqs)), key=lambda i: len(seqs[i]))
        length, context = len(seqs[row]), self.config.max_position_embeddings
        if length + max_new_tokens <= context:
            return
        if not max_new_tokens:
            what = f"sequence {row} of {length} tokens"
        else:
            prompt = f"longest prompt (sequence {row})" if len(seqs) > 1 else "prompt"
            what = f"{prompt} of {length} tokens + max_new_tokens {max_new_tokens} = {length + max_new_tokens}"
        raise ValueError(
            f"{what} exceeds the model's context of {context} "
            f"(max_position_embeddings in {self.path / 'config.json'})"
        )

    def _non_finite(self, tokens: list[int], where: str) -> NonFiniteLogitsError:
        """The error for logits at `where` that are not finite, `tokens` the sequence that produced them.

        On this error path only, a diagnostic forward pass over `tokens` finds the first stage (embeddings,
        layer, final norm and LM head) whose output is not finite.
        """
        finite = np.asarray(_finite_stages_program(self.config, self.weights, np.asarray([tokens], np.int32)))
        return NonFiniteLogitsError(
            f"{self.path}: the logits of {where} are not finite (NaN or infinity); {_stage_at_fault(finite)}. "
            "The weights are corrupt, or config.json holds values that break the math"
        )

    # ----------------------------------------------------------------------------- generation

    def _steps(self, seqs: list[list[int]], max_new_tokens, params: SamplingParams) -> Iterator[np.ndarray]:
        """Checks max_new_tokens and the context now, and returns the iterator of _run over the request."""
        max_new_tokens = _check_max_new_tokens(max_new_tokens)
        self._check_context(seqs, max_new_tokens)
        return self._run(seqs, max_new_tokens, params)

    def _run(self, seqs: list[list[int]], max_new_tokens: int, params: SamplingParams) -> Iterator[np.ndarray]:
        """Yields the next token of every sequence, step after step, up to max_new_tokens steps: the sequences
        prefilled together, then each in a slot of a decode Engine of their own.

        Two or more sequences decode as two micro-batches interleaved in one program (dual_batch), so
        that each one's GPU work hides the other's CPU experts.
        """
        longest = max(len(s) for s in seqs)
        engine = Engine(self, len(seqs), min(bucket(longest + max_new_tokens), self.config.max_position_embeddings))
        rows = [dataclasses.replace(params, row=i) for i in range(len(seqs))]  # distinct draws per sequence
        prefilled = engine.prefill(seqs, rows)
        for slot in range(len(seqs)):
            engine.insert(prefilled, slot, slot, rows[slot])
        current = (prefilled.tokens[None], prefilled.finite[None])  # [steps, b], as a decode call's
        produced = []  # the tokens of each step so far, for the diagnosis of logits that are not finite
        while len(produced) < max_new_tokens:
            # Dispatch the next call before waiting on this one's tokens.
            upcoming = engine.generate() if len(produced) + len(current[0]) < max_new_tokens else None
            rows, finite = np.asarray(current[0]), np.asarray(current[1])
            raise_gpu_errors()  # a CPU expert job that failed while the GPU waited: its step is garbage
            for tokens, ok in zip(rows[: max_new_tokens - len(produced)], finite, strict=False):
                if not ok.all():
                    row = int(np.argmin(ok))
                    sequence = seqs[row] + [int(t[row]) for t in produced]
                    raise self._non_finite(sequence, f"sequence {row}, new token {len(produced) + 1},")
                produced.append(tokens)
                yield tokens
            if upcoming is not None:
                current = (upcoming.tokens(), upcoming.finite())

    def generate(
        self,
        prompt,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: str | Sequence[str] | None = None,
        seed: int = 0,
    ):
        """Completes a prompt: text -> text, list of texts -> list of texts, token ids -> new token ids,
        list of token-id lists -> list of new token-id lists.

        Generation of a sequence ends at an end-of-sequence token (kept in token outputs), at a stop string
        (text outputs end before it) or after max_new_tokens. temperature=0 is greedy and deterministic.
        """
        seqs, kind = self._encode(prompt)
        stops = self._stop_strings(stop)
        params = SamplingParams(temperature, top_k, top_p, seed)
        new = [[] for _ in seqs]
        done = [False] * len(seqs)
        for tokens in self._steps(seqs, max_new_tokens, params):
            for i, token in enumerate(tokens.tolist()):
                if done[i]:
                    continue
                new[i].append(token)
                done[i] = token in self.config.eos_token_ids or (
                    bool(stops) and first_stop(self.tokenizer.decode(new[i]), stops) is not None
                )
            if all(done):
                break
        if kind == "ids":
            return new[0]
        if kind == "id_lists":
            return new
        texts = [text[: first_stop(text, stops)] for text in map(self.tokenizer.decode, new)]
        return texts[0] if kind == "text" else texts

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: str | Sequence[str] | None = None,
        seed: int = 0,
    ) -> Iterator:
        """Like generate for one prompt, yielding text deltas (text prompt) or token ids as they come.

        With stop strings (text prompts only) the text ends before the first one, as in generate: the
        deltas never hold any part of it, since a tail that may begin one is held back until it is clear.
        The arguments are checked by this call, before the iterator it returns runs the first step.
        """
        seqs, kind = self._encode(prompt)
        if len(seqs) != 1:
            raise ValueError("stream takes one prompt")
        stops = self._stop_strings(stop)
        if stops and kind != "text":
            raise ValueError("stop strings need a text prompt in stream (a token-id prompt streams token ids)")
        steps = self._steps(seqs, max_new_tokens, SamplingParams(temperature, top_k, top_p, seed))
        return self._stream(steps, IncrementalDecoder(self.tokenizer, stops) if kind == "text" else None)

    def _stream(self, steps: Iterator[np.ndarray], decoder: IncrementalDecoder | None) -> Iterator:
        for tokens in steps:
            token = int(tokens[0])
            if token in self.config.eos_token_ids:
                break
            if decoder is None:
                yield token
                continue
            if delta := decoder.push(token):
                yield delta
            if decoder.stopped:
                return
        if decoder is not None and (rest := decoder.flush()):
            yield rest

    def _stop_strings(self, stop) -> list[str]:
        """generate's and stream's `stop` (a str, a list of str or None) as a list of non-empty strings."""
        stops = [stop] if isinstance(stop, str) else stop
        if stops is None:
            return []
        if not isinstance(stops, Sequence) or not all(isinstance(s, str) for s in stops):
            raise TypeError(f"stop must be a str or a list of str, got {stop!r:.60}")
        if not all(stops):
            raise ValueError(f"stop strings must not be empty (one would match at once), got {stop!r:.60}")
        if stops and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer; {no_tokenizer(self.path)}")
        return list(stops)


PROMPT_KINDS = "a str, a list of str, a list of token ids or a list of token-id lists"


def _is_array_like(value) -> bool:
    """A sequence of items (list, tuple, numpy or JAX array), not text."""
    return isinstance(value, Sequence | np.ndarray | jax.Array) and not isinstance(value, str | bytes | bytearray)


def _check_max_new_tokens(max_new_tokens) -> int:
    max_new_tokens = integer("max_new_tokens", max_new_tokens)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    return max_new_tokens


def _stage_at_fault(finite: np.ndarray) -> str:
    """Names the first False of a family's finite_stages: embeddings, layers, then final norm and LM head."""
    bad = np.flatnonzero(~finite)
    if not bad.size:
        return "layer unknown (a whole-sequence forward pass over this sequence is finite)"
    if bad[0] == 0:
        return "the token embeddings are not finite (model.embed_tokens.weight)"
    if bad[0] < finite.size - 1:
        return f"the first layer whose output is not finite is layer {bad[0] - 1} (model.layers.{bad[0] - 1}.*)"
    return "every layer's output is finite but the final norm or the LM head is not (model.norm.weight, lm_head.weight)"


def load(
    name_or_path=None, *, dtype=None, placement: Placement | None = None, progress: Progress | None = None
) -> Model:
    """Loads a checkpoint by path, Hugging Face repo id or known name; no argument loads the embedded model.

    `placement` says where the parts run (default: Placement.default(dtype): the first accelerator, else
    the CPU, with routed experts in host memory; long prompts streamed over every GPU that the experts split
    evenly over); `dtype` ("float32" or "bfloat16", or jnp.float32,
    jnp.bfloat16) sets its compute dtype.
    """
    if dtype is not None:
        dtype = compute_dtype(dtype)
        if placement is not None and placement.dtype != dtype:
            raise ValueError(f"dtype {dtype.name!r} contradicts placement.dtype {placement.dtype}: pass one of them")
    path = resolve_model(name_or_path)
    config, ckpt = open_checkpoint(path)
    if placement is None or placement.pinned_experts:  # before Placement.default touches a device
        size_host_memory_pool(routed_expert_bytes(config, ckpt), placement and placement.device)
    placement = placement or Placement.default(dtype, experts=config.n_routed_experts)
    loader = WeightLoader(config, ckpt, placement, progress)
    weights, expert_layers = loader.load()
    model = Model(path, config, weights, expert_layers, tokenizer=open_tokenizer(path, config, ckpt),
                  placement=placement, loader=loader)
    if placement.resident_experts is not None and loader.expert_names:
        try:
            model.place_experts(placement.resident_experts)
        except BaseException:
            model.close()
            raise
    return model
