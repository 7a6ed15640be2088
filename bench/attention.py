"""The causal attention kernels available to prefill at DeepSeek-V3's shapes, against the dense GEMM rate.

    python bench/attention.py [--tokens 16384 65536]

Stream-loaded prefill at 64K tokens is bound by its attention core (bench/RESULTS.md), so its TTFT floor depends
on how close a causal attention kernel comes to the dense bf16 GEMM rate at MLA's head dims: 128 heads, query/key
192 (128 + 64 rope), value 128. This times, on one GPU, in one process:
  cudnn_192_128   cuDNN's fused attention with the value head dim 128 (what stream_prefill runs);
  cudnn_192_192   the same with the values zero-padded to 192 (equal head dims; 20% more multiply-adds);
  mosaic_192_192  Pallas Mosaic GPU's Hopper attention (jax.experimental.pallas.ops.gpu.attention_mgpu), which
                  takes equal head dims in float16 only: values padded to 192, inputs cast to float16.
TFLOP/s count the useful work (query/key 192 + value 128 over the causal triangle) for every variant, so the
figures compare directly; `ratio_to_gemm` divides by a dense 8192^3 bf16 GEMM measured by the same run.
Ends with one JSON line.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp

from prefill import gemm_tflops

HEADS, QK_DIM, V_DIM = 128, 192, 128


def seconds(fn, *args, repeats=5) -> float:
    """Mean seconds of fn(*args) over `repeats` calls back to back, after one compiling call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def pad_values(v):
    return jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, QK_DIM - V_DIM)))


def variants(scale):
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    def cudnn(q, k, v):
        return dot_product_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL, qkv_layout="BTNH")

    def mosaic(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        # The largest blocks whose shared memory fits an H100 at head dim 192 (64/128 and 4 steps do not).
        config = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=True)
        f16 = [a.astype(jnp.float16) for a in (q * scale, k, pad_values(v))]
        return attention_mgpu.attention(*f16, config)[..., :V_DIM]

    return {
        "cudnn_192_128": cudnn,
        "cudnn_192_192": lambda q, k, v: cudnn(q, k, pad_values(v))[..., :V_DIM],
        "mosaic_192_192": mosaic,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536])
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    gemm = gemm_tflops(device)
    print(f"attention: {device.device_kind}; dense bf16 GEMM {gemm:.1f} TFLOP/s")
    results = []
    for length in args.tokens:
        keys = jax.random.split(jax.random.key(length), 3)
        shapes = [(1, length, HEADS, QK_DIM), (1, length, HEADS, QK_DIM), (1, length, HEADS, V_DIM)]
        q, k, v = (jax.device_put(jax.random.normal(key, shape, jnp.bfloat16), device)
                   for key, shape in zip(keys, shapes, strict=True))
        flops = 2.0 * HEADS * length * (length + 1) / 2 * (QK_DIM + V_DIM)
        for name, fn in variants(QK_DIM**-0.5).items():
            case = {"tokens": length, "kernel": name}
            try:
                s = seconds(jax.jit(fn), q, k, v)
            except Exception as e:  # a kernel that does not take these shapes here is a finding, not a failure
                case["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"{length:6d} {name:15s} {case['error']}")
            else:
                tflops = flops / s / 1e12
                case.update(ms=round(1e3 * s, 2), tflops=round(tflops, 1), ratio_to_gemm=round(tflops / gemm, 3))
                print(f"{length:6d} {name:15s} {case['ms']:9.2f} ms {tflops:6.0f} TFLOP/s {tflops / gemm:6.1%} of GEMM")
            results.append(case)
        del q, k, v
    print(json.dumps({"bench": "attention", "device": device.device_kind, "gemm_tflops": round(gemm, 1),
                      "heads": HEADS, "qk_head_dim": QK_DIM, "v_head_dim": V_DIM, "results": results}))


if __name__ == "__main__":
    main()
