"""The offline batch's performance model (hybridjit/offline_policy.py) on real geometries: the shapes of its
predictions (batch 1 near the measured hybrid decode, throughput growing with the batch while the experts are
read-bound), the memory bound on the slots, and the user's choices kept."""

import dataclasses
import types

import jax.numpy as jnp
import pytest

from hybridjit import machine_floors
from hybridjit.auto_placement import kv_cache_bytes
from hybridjit.machine_floors import MachineFloors
from hybridjit.models.registry import GEOMETRIES
from hybridjit.offline_policy import (
    CO_EXECUTION_TOKENS,
    DUAL,
    RESIDENT,
    Floors,
    Policy,
    Workload,
    co_execution_threads,
    cpu_attention_seconds,
    cpu_expert_seconds,
    decode_step,
    kv_bytes_per_slot,
    predict,
    resident_expert_seconds,
    search,
    stream_ring_bytes,
    widened_expert_bytes,
)
from hybridjit.prefill_path import PrefillRates
from hybridjit.stream_prefill import decode_scores_bytes
from hybridjit.synthetic import geometry_config

V3 = geometry_config("deepseek-v3", weight_format="fp8")
QWEN = geometry_config("qwen3-30b-a3b", weight_format="bf16")
WORK = Workload(requests=4096, prompt_tokens=512, new_tokens=256, cache_len=1024)
FLOORS = Floors(device_free_bytes=40 << 30)


def test_batch_1_is_the_measured_hybrid_decode():
    # bench/RESULTS.md: DeepSeek-V3 FP8 at batch 1 projected to 61 layers, 5.1-5.9 tok/s on this floor.
    p = predict(V3, FLOORS, WORK, Policy(1, 1, 1), 2, can_stream=True)
    assert 4.5 < p.decode_tok_s < 7


@pytest.mark.parametrize("cfg", [V3, QWEN], ids=["deepseek-v3", "qwen3-30b-a3b"])
def test_decode_throughput_grows_with_the_batch_and_coalescing_beats_dual_at_large_batches(cfg):
    rates = [predict(cfg, FLOORS, WORK, Policy(b, 1, 1), 2, True).decode_tok_s for b in (1, 8, 64, 256)]
    assert rates == sorted(rates) and rates[-1] > 5 * rates[0]
    dual = predict(cfg, FLOORS, WORK, Policy(256, DUAL, 1), 2, True).decode_tok_s
    assert dual < rates[-1]  # two expert calls read the experts twice


def test_the_slots_kv_cache_fits_the_free_device_memory():
    best = search(QWEN, FLOORS, WORK, 2, True)
    assert best.slots * kv_bytes_per_slot(QWEN, WORK.cache_len, 2) <= FLOORS.device_free_bytes
    more = search(QWEN, dataclasses.replace(FLOORS, device_free_bytes=80 << 30), WORK, 2, True)
    assert more.slots > best.slots and more.prediction.total_tok_s > best.prediction.total_tok_s


def test_the_users_choices_are_kept_and_the_rest_searched():
    policy = search(V3, FLOORS, WORK, 2, True, slots=24, micro_batches=DUAL)
    assert (policy.slots, policy.micro_batches) == (24, DUAL) and policy.prefill_batch <= 24
    assert "24 slots, dual-batch overlap" in policy.describe() and "predicted" in policy.describe()


def test_no_slot_fits_is_a_clear_error():
    with pytest.raises(ValueError, match="no policy of the grid fits the device's 0.00 GiB free"):
        search(V3, dataclasses.replace(FLOORS, device_free_bytes=1 << 20), WORK, 2, True)


def test_the_cpu_rate_by_tokens_per_call_prices_each_batch_at_its_own_rate():
    """Floors.cpu_tflops interpolates the measured rates in log-log, holds them at the ends, and the expert time of a
    compute-bound batch follows the rate measured at its size, not the one figure at 4096 tokens."""
    curve = Floors(cpu_expert_tflops=4.5, cpu_expert_tflops_by_tokens=((64, 1.0), (1024, 2.0), (4096, 4.5)))
    assert curve.cpu_tflops(64) == pytest.approx(1.0) and curve.cpu_tflops(1024) == pytest.approx(2.0)
    assert curve.cpu_tflops(256) == pytest.approx(2 ** 0.5)  # halfway in log tokens, halfway in log rate
    assert curve.cpu_tflops(1) == pytest.approx(1.0) and curve.cpu_tflops(1 << 20) == pytest.approx(4.5)
    assert Floors(cpu_expert_tflops=4.5).cpu_tflops(64) == 4.5
    flat = dataclasses.replace(curve, cpu_expert_tflops_by_tokens=())
    at_1024 = [predict(V3, f, WORK, Policy(1024, 1, 1), 2, True).expert_s for f in (curve, flat)]
    assert at_1024[0] == pytest.approx(at_1024[1] * 4.5 / 2.0, rel=1e-6)  # every V3 expert read: FLOP-bound


def test_the_experts_are_streamed_where_the_cpu_is_slower_than_the_link_at_that_batch():
    """The search puts the routed experts on the CPU or streams them to the GPU, whichever its floors price faster
    at the batch: V3's 512-slot step reads nearly every expert either way, and at 1 TFLOP/s the CPU takes longer
    than the link; at 64 slots a 40 TFLOP/s CPU reads its experts sooner than the link brings them, while the
    copies would take from its read floor. Streaming decodes one micro-batch."""
    slow = Floors(device_free_bytes=200 << 30, cpu_expert_tflops_by_tokens=((1, 0.05), (512, 1.0), (4096, 4.0)))
    fast = dataclasses.replace(slow, cpu_expert_tflops_by_tokens=((1, 2.0), (512, 40.0)))
    streamed = search(V3, slow, WORK, 2, True, slots=512)
    assert streamed.experts == "stream" and streamed.micro_batches == 1
    assert "streamed to the GPU each step" in streamed.describe()
    assert search(V3, fast, WORK, 2, True, slots=64).experts == "cpu"
    assert search(V3, slow, WORK, 2, False, slots=512).experts == "cpu"  # nothing pinned to stream from
    on_cpu = search(V3, slow, WORK, 2, True, slots=512, experts="cpu")
    assert on_cpu.experts == "cpu" and on_cpu.prediction.total_tok_s < streamed.prediction.total_tok_s


def test_co_execution_leaves_the_cpu_its_share_where_the_cpu_and_the_link_balance():
    """Streaming V3's experts at 1024 slots, the CPU computes some of each layer's blocks meanwhile (CoX-MoE): as
    many as its rate at that batch takes no longer than the link takes for the rest. The split is faster than
    either placement alone; a faster CPU takes more blocks, a CPU far slower than the link none; a fixed split is
    kept and priced."""
    def split(rate):
        floors = Floors(device_free_bytes=200 << 30, cpu_expert_tflops_by_tokens=((1, rate / 20), (4096, rate)))
        best = search(V3, floors, WORK, 2, True, slots=1024)
        alone = [search(V3, floors, WORK, 2, True, slots=1024, experts=e, cpu_blocks=0 if e == "stream" else None)
                 for e in ("cpu", "stream")]  # fmt: skip
        return best, alone

    best, (cpu, stream) = split(1.4)  # the CPU's FP8 rate at 1024 slots (bench/RESULTS.md, offline)
    assert best.experts == "stream" and 0 < best.cpu_blocks < 8
    assert best.prediction.total_tok_s > max(cpu.prediction.total_tok_s, stream.prediction.total_tok_s)
    assert f"the CPU computing {best.cpu_blocks} of each layer's 8 blocks" in best.describe()
    faster, _ = split(4.0)
    assert faster.cpu_blocks > best.cpu_blocks
    assert split(0.05)[0].cpu_blocks == 0
    floors = Floors(device_free_bytes=200 << 30, cpu_expert_tflops_by_tokens=((1, 0.07), (4096, 1.4)))
    fixed = search(V3, floors, WORK, 2, True, slots=1024, cpu_blocks=7)
    assert fixed.experts == "stream" and fixed.cpu_blocks == 7
    assert fixed.prediction.total_tok_s < best.prediction.total_tok_s


@pytest.mark.parametrize(("options", "message"), [
    ({"experts": "gpu"}, "experts must be one of cpu, stream"),
    ({"experts": "stream", "micro_batches": 2}, "decodes one micro-batch"),
    ({"experts": "cpu", "cpu_blocks": 2}, "cpu_blocks=2 splits a streamed step's experts; it needs experts='stream'"),
    ({"cpu_blocks": 8}, r"cpu_blocks must be in \[0, 8\)"),
])  # fmt: skip
def test_bad_expert_choices_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        search(V3, FLOORS, WORK, 2, True, **options)
    with pytest.raises(ValueError, match="needs the routed experts pinned"):
        search(V3, FLOORS, WORK, 2, False, experts="stream")


def test_streaming_is_chosen_only_where_its_ring_fits_beside_the_kv_cache():
    """A streamed step needs two expert blocks and its attention scores on the device besides the KV cache: where
    the slots' cache leaves less, the experts stay on the CPU however slow it is. A forced choice the grid cannot
    hold is a clear error, on a device of unbounded memory too."""
    slow = ((1, 0.05), (512, 1.0), (4096, 4.0))
    long_decode = Workload(requests=4096, prompt_tokens=100, new_tokens=900, cache_len=1024)
    kv = 192 * kv_bytes_per_slot(V3, long_decode.cache_len, 2)
    tight = Floors(device_free_bytes=kv + (1 << 28), cpu_expert_tflops_by_tokens=slow)
    on_device = {"kv_in_host": False}
    assert search(V3, tight, long_decode, 2, True, slots=192, **on_device).experts == "cpu"
    roomy = dataclasses.replace(tight, device_free_bytes=kv + stream_ring_bytes(V3, 192, 1024) + (1 << 30))
    assert search(V3, roomy, long_decode, 2, True, slots=192, **on_device).experts == "stream"
    forced = "no policy of the grid with slots=192, experts='stream' fits the device's .* GiB free"
    with pytest.raises(ValueError, match=forced):
        search(V3, tight, long_decode, 2, True, slots=192, experts="stream", **on_device)


def test_the_kv_cache_in_host_memory_trades_link_time_for_slots_the_device_cannot_hold():
    """Streaming V3's experts, a 40 GiB device holds the KV cache of a few hundred slots (61 layers of MLA latents,
    0.067 GiB a slot at 1,024 positions). In host memory every slot's cache also crosses the link each step (priced:
    the step grows by those bytes at the pinned rate) and the device holds two layers' caches, so the slots are
    bounded by the host instead: the search takes more of them, for more throughput, within the host's memory. The
    cache in host memory is for streamed steps only."""
    slow = Floors(device_free_bytes=40 << 30, host_free_bytes=1 << 40,
                  cpu_expert_tflops_by_tokens=((1, 0.05), (512, 1.0), (4096, 4.0)))  # fmt: skip
    per_slot = kv_bytes_per_slot(V3, WORK.cache_len, 2)
    on_device = search(V3, slow, WORK, 2, True, experts="stream", kv_in_host=False)
    in_host = search(V3, slow, WORK, 2, True, experts="stream")
    assert not on_device.kv_in_host and on_device.slots * per_slot <= slow.device_free_bytes
    assert in_host.kv_in_host and in_host.slots > 2 * on_device.slots
    assert "KV cache in host memory" in in_host.describe()
    assert in_host.prediction.decode_tok_s > 1.5 * on_device.prediction.decode_tok_s
    # No CPU blocks beside a cache in host memory unless asked for (measured slower, offline_policy._searched_splits),
    # though this host's kernels make the model price co-execution faster.
    assert in_host.cpu_blocks == 0
    asked = search(V3, slow, WORK, 2, True, slots=in_host.slots, prefill_batch=64, cpu_blocks=3, kv_in_host=True)
    assert asked.cpu_blocks == 3 and asked.prediction.step_s < in_host.prediction.step_s
    link_bound = dataclasses.replace(slow, gpu_tflops=1e9, gpu_hbm_gbps=1e9)  # the step is the copies
    steps = [predict(V3, link_bound, WORK, Policy(2048, 1, 1, experts="stream", kv_in_host=h), 2, True).step_s
             for h in (False, True)]  # fmt: skip
    assert steps[1] - steps[0] == pytest.approx(2048 * per_slot / (slow.pcie_gbps * 1e9), rel=1e-6)
    small_host = dataclasses.replace(slow, host_free_bytes=1000 * per_slot)
    bounded = search(V3, small_host, WORK, 2, True, experts="stream", kv_in_host=True)
    assert bounded.slots * per_slot <= small_host.host_free_bytes and bounded.slots < in_host.slots
    # Fixed slots with the holding searched: only one that holds them, whichever the model prices faster.
    assert search(V3, slow, WORK, 2, True, slots=2048, prefill_batch=64).kv_in_host  # 137 GiB: not the device
    tiny_host = dataclasses.replace(slow, host_free_bytes=100 * per_slot)
    assert not search(V3, tiny_host, WORK, 2, True, slots=256, experts="stream").kv_in_host  # the device holds them
    with pytest.raises(ValueError, match=r"fits the device's 40.00 GiB free \(and a cache in host memory .* of it\)"):
        search(V3, small_host, WORK, 2, True, slots=2048, experts="stream")
    for options in ({"experts": "cpu"}, {"micro_batches": 2}):
        with pytest.raises(ValueError, match="kv_in_host=True: the KV cache in host memory is read by streamed"):
            search(V3, slow, WORK, 2, True, kv_in_host=True, **options)
    with pytest.raises(ValueError, match="kv_in_host=True: .* this model's are not pinned for streaming"):
        search(V3, slow, WORK, 2, False, kv_in_host=True)


def test_attention_on_the_cpu_takes_the_cache_off_the_link_at_the_cpus_rate():
    """With the KV cache in host memory the CPU may attend over it there (MoE-Gen): the link then carries only the
    experts, and each layer's attention takes the larger of reading the cache at what the host read floor leaves
    beside the copies and its FLOPs at the CPU kernels' measured rate, before the layer's experts. GQA's 8 FLOPs a
    byte make it read-bound at 2 TFLOP/s, so it beats carrying the cache over PCIe (54 GB/s) at the 101 GB/s the
    host's 155 leave; MLA's 128 heads, ~256 FLOPs
    a byte, make it compute-bound, slower than the link where the kernels are slow. It is searched only where asked
    for, and refused there where its rate is not measured."""
    measured = Floors(device_free_bytes=40 << 30, host_free_bytes=1 << 40, cpu_attention_gflops=2000.0)
    link_bound = dataclasses.replace(measured, gpu_tflops=1e9, gpu_hbm_gbps=1e9, gpu_layer_us=0.0)
    context = WORK.prompt_tokens + WORK.new_tokens / 2
    for cfg in (QWEN, V3):
        over_link, on_cpu = (predict(cfg, link_bound, WORK, Policy(2048, 1, 1, experts="stream", kv_in_host=True,
                                                                   attention_on_cpu=c), 2, True).step_s
                             for c in (False, True))  # fmt: skip
        experts_only = predict(cfg, link_bound, WORK, Policy(2048, 1, 1, experts="stream"), 2, True).step_s
        # The CPU reads the cache beside the link's copies, which take their rate off its read floor.
        beside = dataclasses.replace(measured, host_read_gbps=measured.host_read_gbps - measured.pcie_gbps)
        attention = cpu_attention_seconds(cfg, beside, 2048, context, 2)
        assert on_cpu == pytest.approx(max(experts_only, attention), rel=1e-6)
        reads = 2048 * kv_bytes_per_slot(cfg, int(context), 2) / (beside.host_read_gbps * 1e9)
        assert attention >= reads
        if cfg is QWEN:
            assert attention == pytest.approx(reads) and on_cpu < over_link
    # V3's kernels at 0.5 TFLOP/s: the CPU's attention alone takes longer than the whole step over the link.
    slow = dataclasses.replace(measured, cpu_attention_gflops=500.0)
    assert cpu_attention_seconds(V3, slow, 2048, context, 2) > over_link
    # Searched only where asked for (measured at 0.32-0.38 of this model, session 31), then priced as above.
    assert not search(QWEN, measured, WORK, 2, True, experts="stream", kv_in_host=True).attention_on_cpu
    asked = search(QWEN, measured, WORK, 2, True, experts="stream", kv_in_host=True, attention_on_cpu=True)
    assert asked.attention_on_cpu and "attended over on the CPU" in asked.describe()
    unmeasured = dataclasses.replace(measured, cpu_attention_gflops=None)
    with pytest.raises(ValueError, match="attention on the CPU: its kernels' rate is not measured"):
        search(QWEN, unmeasured, WORK, 2, True, attention_on_cpu=True)
    with pytest.raises(ValueError, match="attention_on_cpu=True: the CPU attends over a KV cache in host memory"):
        search(QWEN, measured, WORK, 2, True, kv_in_host=False, attention_on_cpu=True)


def test_resident_fp8_experts_are_priced_as_the_grouped_path_computes_them():
    """FP8 resident copies halve a gathered step's reads (1 byte a weight against bfloat16's 2), but a grouped step
    (more pairs than experts) dequantizes every copy each call: 1 byte read, 2 written and 2 read again, 2.5x what
    bfloat16 copies cost (bench/RESULTS.md, offline.py session 27: 0.21 of a prediction without it)."""
    fp8 = geometry_config("qwen3-30b-a3b", weight_format="fp8")
    memory_bound = dataclasses.replace(FLOORS, gpu_tflops=1e9)
    gathered, grouped = 1, 256  # 8 and 2048 pairs over 128 experts
    ratio = [resident_expert_seconds(fp8, memory_bound, t, 2) / resident_expert_seconds(QWEN, memory_bound, t, 2)
             for t in (gathered, grouped)]  # fmt: skip
    assert ratio == pytest.approx([0.5, 2.5], rel=0.01)


def test_widened_fp8_copies_cost_what_bfloat16_copies_do_and_their_memory_is_traded_against_slots():
    """FP8 copies held dequantized for the run read as bfloat16 copies do on both paths (so the grouped path is
    2.5x cheaper than with FP8 copies, the gathered one 2x dearer), and cost their extra bytes of device memory:
    chosen where that memory would not buy more throughput as KV slots, not chosen where it does not fit."""
    fp8 = geometry_config("qwen3-30b-a3b", weight_format="fp8")
    memory_bound = dataclasses.replace(FLOORS, gpu_tflops=1e9)
    for tokens in (1, 256):
        widened = resident_expert_seconds(fp8, memory_bound, tokens, 2, widened=True)
        assert widened == pytest.approx(resident_expert_seconds(QWEN, memory_bound, tokens, 2), rel=0.01)
    extra = widened_expert_bytes(fp8, 2)
    assert widened_expert_bytes(QWEN, 2) == 0 and 25e9 < extra < 30e9  # 48 x 128 experts of 3 x 2048 x 768, +1 byte
    roomy = dataclasses.replace(FLOORS, device_free_bytes=120 << 30)
    best = search(fp8, roomy, WORK, 2, False, resident=True)
    assert best.widened and "held dequantized for the run" in best.describe()
    as_stored = search(fp8, roomy, WORK, 2, False, resident=True, widened=False)
    assert best.prediction.total_tok_s > as_stored.prediction.total_tok_s
    tight = dataclasses.replace(FLOORS, device_free_bytes=extra)  # the widening alone would fill it
    assert not search(fp8, tight, WORK, 2, False, resident=True).widened
    with pytest.raises(ValueError, match="widened=True holds resident FP8 copies dequantized; this model holds its"):
        search(QWEN, FLOORS, WORK, 2, False, resident=True, widened=True)


def test_resident_experts_are_priced_on_the_gpu():
    """A model holding every routed expert on the device runs them there: its steps read them from HBM (a batch of
    one reads its top-k experts per layer, a large batch all of them: far faster than the CPU either way), its
    prefill computes them on the GPU, and no choice of where they run is offered."""
    for tokens in (1, 1024):
        on_gpu, on_cpu = resident_expert_seconds(QWEN, FLOORS, tokens, 2), cpu_expert_seconds(QWEN, FLOORS, tokens)
        assert 0 < 10 * on_gpu < on_cpu
    best = search(QWEN, FLOORS, WORK, 2, False, resident=True)
    assert best.experts == RESIDENT and best.micro_batches != DUAL and best.cpu_blocks == 0
    assert best.prediction.expert_s == resident_expert_seconds(QWEN, FLOORS, best.slots, 2)
    hybrid = search(QWEN, FLOORS, WORK, 2, False, slots=best.slots, prefill_batch=best.prefill_batch)
    assert best.prediction.decode_tok_s > 2 * hybrid.prediction.decode_tok_s
    assert best.prediction.prefill_s < hybrid.prediction.prefill_s
    for options in ({"experts": "stream"}, {"micro_batches": DUAL}):
        with pytest.raises(ValueError, match="every routed expert of this model is resident on the device"):
            search(QWEN, FLOORS, WORK, 2, True, resident=True, **options)


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_a_slots_kv_bytes_are_the_engines_cache_windows_as_rings(geometry):
    """What the model prices a slot's cache at (device or host memory, the host cache's copies over the link) is
    what the engine allocates, the family's init_cache with rings: gpt-oss-120b's sliding layers hold their 128
    positions, not the context (at 8,192 positions its slot is 0.51 of all layers' full length); a prompt's cache,
    which prefill writes whole, is priced whole."""
    cfg = geometry_config(geometry, weight_format="bf16")
    for cache_len in (1024, 8192):
        assert kv_bytes_per_slot(cfg, cache_len, 2) == kv_cache_bytes(cfg, jnp.bfloat16, 1, cache_len)
        whole = kv_bytes_per_slot(cfg, cache_len, 2, rings=False)
        windowed = any(cfg.window(i) for i in range(cfg.num_hidden_layers))
        assert (kv_bytes_per_slot(cfg, cache_len, 2) < whole) == windowed



def test_a_decode_steps_scores_span_the_widest_layers_positions():
    """A decode step's attention scores are priced over the most positions one layer attends: the whole cache where
    any layer attends fully (gpt-oss's full layers), a window where every layer is windowed (Mixtral with one)."""
    mixtral = geometry_config("mixtral-8x7b", weight_format="bf16")
    windowed = dataclasses.replace(mixtral, sliding_window=256)
    per_position = 3 * 4 * 8 * mixtral.num_attention_heads
    assert decode_scores_bytes(mixtral, 8, 8192) == per_position * 8192
    assert decode_scores_bytes(windowed, 8, 8192) == per_position * 256
    assert decode_scores_bytes(windowed, 8, 100) == per_position * 100
    gpt_oss = geometry_config("gpt-oss-120b", weight_format="bf16")
    assert decode_scores_bytes(gpt_oss, 8, 8192) == 3 * 4 * 8 * gpt_oss.num_attention_heads * 8192


def test_on_a_gpu_machine_the_co_executed_share_is_the_rate_beside_the_links_copies_over_the_rate_alone(monkeypatch):
    """Floors.of_machine measures co_execution_share: the CPU expert rate at CO_EXECUTION_TOKENS of a co-executed
    share's call (one block's experts, on co_execution_threads(), while the link copies), over the rate at those
    tokens alone on the whole pool."""
    asked = []

    def rate(tokens=4096, threads=None, co_executed=False):
        asked.append((tokens, threads, co_executed))
        return 0.9 if co_executed else 3.0

    model = types.SimpleNamespace(placement=types.SimpleNamespace(device=types.SimpleNamespace(platform="gpu")),
                                  expert_layers=[object()], cpu_expert_tflops=rate,
                                  prefill_rates=lambda: PrefillRates(50.0, 700.0, 3.0))
    machine = MachineFloors("a gpu", host_read_gbps=150.0, pcie_gbps=50.0, gpu_tflops=700.0, gpu_hbm_gbps=3e3)
    monkeypatch.setattr(machine_floors.FloorCache, "floors", lambda self, device: machine)
    floors = Floors.of_machine(model)
    assert floors.co_execution_share == pytest.approx(0.3)
    assert (CO_EXECUTION_TOKENS, co_execution_threads(), True) in asked
    assert (CO_EXECUTION_TOKENS, None, False) in asked


def test_a_co_executed_steps_cpu_share_runs_at_the_pools_share_of_the_rate():
    """The CPU's blocks of a co-executed streamed step are priced at co_execution_share of the kernels' compute rate
    (their pool leaves the host's loop its CPUs): with half the rate the CPU's part takes twice as long where compute
    binds it, while a step that streams every block is priced as before."""
    full = dataclasses.replace(FLOORS, cpu_expert_tflops_by_tokens=((64, 0.5), (4096, 3.8)))
    half = dataclasses.replace(full, co_execution_share=0.5)
    # The link, the GPU and the host's reads all but free, so the CPU's compute is the step.
    free = {"host_read_gbps": 1e12, "pcie_gbps": 1e9, "gpu_tflops": 1e9, "gpu_hbm_gbps": 1e12, "gpu_layer_us": 0.0,
            "handoff_us": 0.0}
    full, half = (dataclasses.replace(f, **free) for f in (full, half))
    co_executed = [decode_step(QWEN, f, 1024, 640, 1, 2, "stream", cpu_blocks=4)[0] for f in (full, half)]
    assert co_executed[1] == pytest.approx(2 * co_executed[0], rel=0.05)
    streamed = [decode_step(QWEN, f, 1024, 640, 1, 2, "stream")[0] for f in (full, half)]
    assert streamed[0] == streamed[1] < co_executed[0]
