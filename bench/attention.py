"""The causal attention kernels available to prefill at DeepSeek-V3's shapes, against the dense GEMM rate.

    python bench/attention.py [--tokens 16384 65536]

Stream-loaded prefill at 64K tokens is bound by its attention core (bench/RESULTS.md), so its TTFT floor depends
on how close a causal attention kernel comes to the dense bf16 GEMM rate at MLA's head dims: 128 heads, query/key
192 (128 + 64 rope), value 128. This times, on one GPU, in one process:
  cudnn_192_128   cuDNN's fused attention with the value head dim 128 (what stream_prefill runs);
  cudnn_192_192   the same with the values zero-padded to 192 (equal head dims; 20% more multiply-adds);
  mosaic_192_192  Pallas Mosaic GPU's Hopper attention (jax.experimental.pallas.ops.gpu.attention_mgpu), which
                  takes equal head dims in float16 only: values padded to 192, inputs cast to float16.
Each variant's inputs are prepared (padded, cast) before it is timed, and its output is compared with
cudnn_192_128's (`rel_rms_vs_cudnn`), so a kernel that computes something else cannot pass for fast.
TFLOP/s count the useful work (query/key 192 + value 128 over the causal triangle) for every variant, so the
figures compare directly; `ratio_to_gemm` divides by a dense 8192^3 bf16 GEMM measured by the same run, both
timed as the best of three rounds of back-to-back calls.
Ends with one JSON line.
"""

import argparse
import json

import jax
import jax.numpy as jnp

from prefill import best_seconds, gemm_tflops

HEADS, QK_DIM, V_DIM = 128, 192, 128


def pad_values(v):
    return jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, QK_DIM - V_DIM)))


def variants(scale):
    """name: (prepare(q, k, v) -> the kernel's inputs, untimed; the kernel, timed, returning [b, t, h, V_DIM])."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    def cudnn(q, k, v):
        return dot_product_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL, qkv_layout="BTNH")

    def mosaic(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        # The largest blocks whose shared memory fits an H100 at head dim 192 (64/128 and 4 steps do not).
        config = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=True)
        return attention_mgpu.attention(q, k, v, config)[..., :V_DIM]

    return {
        "cudnn_192_128": (lambda q, k, v: (q, k, v), cudnn),
        "cudnn_192_192": (lambda q, k, v: (q, k, pad_values(v)), lambda q, k, v: cudnn(q, k, v)[..., :V_DIM]),
        "mosaic_192_192": (lambda q, k, v: tuple(a.astype(jnp.float16) for a in (q * scale, k, pad_values(v))),
                           mosaic),
    }


def rel_rms(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.sqrt(jnp.mean((a - b) ** 2) / jnp.mean(b**2)))


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
        reference = None
        for name, (prepare, kernel) in variants(QK_DIM**-0.5).items():
            case = {"tokens": length, "kernel": name}
            try:
                inputs = jax.block_until_ready(jax.jit(prepare)(q, k, v))
                run = jax.jit(kernel)
                s = best_seconds(run, *inputs, repeats=5)
                out = run(*inputs)
            except Exception as e:  # a kernel that does not take these shapes here is a finding, not a failure
                case["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"{length:6d} {name:15s} {case['error']}")
            else:
                reference = out if reference is None else reference
                tflops = flops / s / 1e12
                case.update(ms=round(1e3 * s, 2), tflops=round(tflops, 1), ratio_to_gemm=round(tflops / gemm, 3),
                            rel_rms_vs_cudnn=round(rel_rms(out, reference), 5))
                print(f"{length:6d} {name:15s} {case['ms']:9.2f} ms {tflops:6.0f} TFLOP/s {tflops / gemm:6.1%} of GEMM"
                      f"  (rel. RMS vs cuDNN {case['rel_rms_vs_cudnn']:.1e})")
            results.append(case)
            inputs = out = None  # free this variant's buffers before the next
        q = k = v = reference = None
    print(json.dumps({"bench": "attention", "device": device.device_kind, "gemm_tflops": round(gemm, 1),
                      "heads": HEADS, "qk_head_dim": QK_DIM, "v_head_dim": V_DIM, "results": results}))


if __name__ == "__main__":
    main()
