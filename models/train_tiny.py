"""Trains the small DeepSeek-V3-architecture model that ships as hybridjit's embedded default.

    python -m hybridjit.models.train_tiny --out hybridjit/data/default --steps 1200

The model is exactly our DeepSeek-V3 functions (MLA with YaRN RoPE, a dense first layer, shared and
routed experts with sigmoid group-limited routing), trained with jax.grad over them. Routed experts are
JAX-held during training (`MoE.experts`, computed densely: 16 experts are cheap) and the correction bias
is trained the way DeepSeek-V3 balances load without an auxiliary loss: after each step it moves by a
fixed amount towards the experts that were chosen less than average.

Corpus: the Python standard library's own source (free to ship, on every machine), split by file into
training and held-out sets; a byte-level BPE tokenizer is trained on the training files. Seeded and
deterministic for a given Python version and step count.
"""

import argparse
import dataclasses
import json
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hybridjit.export import export_tensors, save_checkpoint
from hybridjit.models import deepseek_v3 as dsv3
from hybridjit.models.stdlib_corpus import BOS, EOS, corpus_files, read_text, token_stream

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 640,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rope_interleave": True,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}
BIAS_UPDATE_RATE = 1e-3  # DeepSeek-V3's gamma for the correction-bias load balancing


def train_tokenizer(files: list[Path], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer)
    return tok


def init_weights(cfg: dsv3.DeepseekV3Config, seed: int) -> dsv3.Weights:
    """Random weights: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms 1, correction biases 0."""
    layout = dsv3.checkpoint_layout(cfg)
    rng = np.random.default_rng(seed)

    def tensor(name, dtype=None):
        shape = layout[name].shape
        if len(shape) == 1:
            return jnp.zeros(shape) if name.endswith("bias") else jnp.ones(shape)
        std = 1.0 if "embed_tokens" in name else shape[1] ** -0.5
        return jnp.asarray(rng.standard_normal(shape, np.float32) * std)

    def routed(names, layer):
        def stack(expert_names):
            shape = layout[expert_names[0]].shape
            return jnp.asarray(rng.standard_normal((len(expert_names), *shape), np.float32) * shape[1] ** -0.5)

        return dsv3.Experts(*(stack(expert_names) for expert_names in names)), None

    return dsv3.build_weights(cfg, tensor, routed)


def next_token_loss(cfg: dsv3.DeepseekV3Config, w: dsv3.Weights, batch: jax.Array):
    """Mean cross-entropy of predicting batch[:, 1:] from batch[:, :-1], and each MoE layer's choices."""
    logits, _, expert_ids = dsv3.forward(cfg, w, batch[:, :-1])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    return loss, expert_ids


def balance_biases(cfg: dsv3.DeepseekV3Config, w: dsv3.Weights, expert_ids: list[jax.Array]) -> dsv3.Weights:
    """Aux-loss-free load balancing: raise the bias of under-used experts, lower that of over-used ones."""
    choices = iter(expert_ids)

    def balanced(layer):
        if not isinstance(layer.mlp, dsv3.MoE):
            return layer
        load = jnp.bincount(next(choices).reshape(-1), length=cfg.n_routed_experts)
        bias = layer.mlp.correction_bias + BIAS_UPDATE_RATE * jnp.sign(load.mean() - load)
        return dataclasses.replace(layer, mlp=dataclasses.replace(layer.mlp, correction_bias=bias))

    return dataclasses.replace(w, layers=[balanced(layer) for layer in w.layers])


def make_train_step(cfg: dsv3.DeepseekV3Config, optimizer):
    @jax.jit
    def step(w, opt_state, batch):
        # The correction bias only steers the (non-differentiable) selection: its gradient is zero and
        # it is excluded from weight decay, so the optimizer leaves it to balance_biases.
        (loss, expert_ids), grads = jax.value_and_grad(next_token_loss, argnums=1, has_aux=True)(
            cfg, w, batch
        )
        updates, opt_state = optimizer.update(grads, opt_state, w)
        w = balance_biases(cfg, optax.apply_updates(w, updates), expert_ids)
        return w, opt_state, loss

    return step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_files, heldout_files = corpus_files(stdlib)
    tok = train_tokenizer(train_files, CONFIG["vocab_size"])
    train_tokens = token_stream(tok, train_files)
    print(
        f"corpus: {stdlib}, {len(train_files)} training files ({train_tokens.size} tokens), "
        f"{len(heldout_files)} held out",
        flush=True,
    )

    cfg = dsv3.DeepseekV3Config.from_hf_config(CONFIG, source="train_tiny.CONFIG")
    w = init_weights(cfg, args.seed)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(100, args.steps // 10), args.steps, args.lr / 10
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            schedule, b2=0.95, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
        ),
    )
    opt_state = optimizer.init(w)
    step = make_train_step(cfg, optimizer)
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    for i in range(args.steps):
        offsets = rng.integers(0, train_tokens.size - args.seq - 1, args.batch)
        batch = np.stack([train_tokens[o : o + args.seq + 1] for o in offsets])
        w, opt_state, loss = step(w, opt_state, batch)
        if i % 50 == 0 or i == args.steps - 1:
            print(f"step {i:5d}  loss {float(loss):.3f}  {time.perf_counter() - start:7.1f} s", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    save_checkpoint(args.out, CONFIG, export_tensors(cfg, w))
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": True,
                "add_eos_token": False,
                "bos_token": BOS,
                "eos_token": EOS,
                "model_max_length": CONFIG["max_position_embeddings"],
                "tokenizer_class": "PreTrainedTokenizerFast",
            },
            indent=2,
        )
        + "\n"
    )
    (args.out / "training.json").write_text(
        json.dumps(
            {
                "python": sysconfig.get_python_version(),
                "steps": args.steps,
                "batch": args.batch,
                "seq": args.seq,
                "lr": args.lr,
                "seed": args.seed,
                "train_files": len(train_files),
                "heldout_files": len(heldout_files),
                "final_loss": float(loss),
                "seconds": round(time.perf_counter() - start, 1),
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
