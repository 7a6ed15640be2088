"""Bad checkpoints and configs fail with errors that name the file, tensor or field at fault."""

import json
import re
import shutil

import numpy as np
import pytest
from checkpoint_factory import tiny_config, write_checkpoint
from safetensors.numpy import save_file

import hybridjit
from hybridjit.checkpoint import Checkpoint, CheckpointError
from hybridjit.config import ConfigError
from hybridjit.engine import NonFiniteLogitsError


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    # With the multi-token-prediction layer, which config.json then declares (num_nextn_predict_layers 1).
    return write_checkpoint(
        tmp_path_factory.mktemp("ckpt"), tiny_config("v3"), seed=5, weight_format="fp8", with_mtp_layer=True
    )


@pytest.fixture
def ckpt(pristine, tmp_path):
    return shutil.copytree(pristine, tmp_path / "ckpt")


def _shard_holding(path, tensor):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][tensor]


def _rewrite_shard(path, tensor, change):
    """Rewrites the shard holding `tensor` after `change` edits its {name: array} dict in place."""
    shard = _shard_holding(path, tensor)
    ckpt = Checkpoint(path)  # safetensors.numpy cannot read float8, our reader can
    tensors = {n: np.array(ckpt.get(n)) for n, info in ckpt.tensors.items() if info.file == shard}
    del ckpt
    change(tensors)
    save_file(tensors, str(shard))
    return shard


def test_pristine_checkpoint_loads(pristine):
    model = hybridjit.load(pristine)
    assert model.config.fp8.block == (128, 128)
    model.close()


def test_truncated_file_names_file_and_tensor(ckpt):
    shard = _shard_holding(ckpt, "model.layers.1.mlp.experts.3.down_proj.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: truncated: tensor \S+ ends at byte"):
        Checkpoint(ckpt)


def test_corrupt_header(ckpt):
    shard = _shard_holding(ckpt, "model.norm.weight")
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\x00\xff\x00\xff"
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name}: corrupt safetensors header"):
        Checkpoint(ckpt)


def test_index_naming_missing_file(ckpt):
    shard = _shard_holding(ckpt, "model.norm.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"names {shard.name}, which does not exist"):
        Checkpoint(ckpt)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.2.self_attn.kv_b_proj.weight",
        "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv",  # the block scales of an FP8 weight
    ],
)
def test_missing_tensor_is_listed(ckpt, name):
    _rewrite_shard(ckpt, name, lambda t: t.pop(name))
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][name]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"missing {name}"):
        hybridjit.load(ckpt)


def test_wrong_shape_names_tensor_and_expectation(ckpt):
    name = "model.layers.0.mlp.up_proj.weight"

    def transpose(t):
        t[name] = np.ascontiguousarray(t[name].T)
        scale = name + "_scale_inv"
        if scale in t:
            t[scale] = np.ascontiguousarray(t[scale].T)

    _rewrite_shard(ckpt, name, transpose)
    with pytest.raises(
        CheckpointError, match=rf"{name} has shape \[200, 264\], config.json implies \[264, 200\]"
    ):
        hybridjit.load(ckpt)


def test_wrong_dtype(ckpt):
    name = "model.norm.weight"
    _rewrite_shard(ckpt, name, lambda t: t.__setitem__(name, np.arange(t[name].size, dtype=np.int32)))
    with pytest.raises(CheckpointError, match=rf"{name} has dtype I32, expected a float type"):
        hybridjit.load(ckpt)


def test_config_inconsistent_with_weights(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["n_routed_experts"] = 8  # the weights hold 16 experts per layer
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.\d+\.mlp\.experts\.\d+"):
        hybridjit.load(ckpt)


def _edit_config(ckpt, **changes):
    config = json.loads((ckpt / "config.json").read_text())
    config.update(changes)
    (ckpt / "config.json").write_text(json.dumps(config))


def test_a_mismatch_with_config_names_its_first_problem_on_the_first_line(ckpt):
    _edit_config(ckpt, n_routed_experts=8)  # 16 experts stored: misshapen gates, unexpected experts
    with pytest.raises(CheckpointError) as error:
        hybridjit.load(ckpt)
    first, *listed = str(error.value).splitlines()
    head = re.fullmatch(
        rf"{re.escape(str(ckpt))} does not match its config\.json: model-\d+-of-\d+\.safetensors: "
        r"model\.layers\.1\.mlp\.gate\.weight has shape \[16, 200\], config\.json implies \[8, 200\]; (\d+) more:",
        first,
    )
    assert head, first
    assert len(listed) == 12 and listed[-1] == f"  ... and {int(head[1]) - 11} more"


def test_too_few_layers_in_the_config_is_not_a_silent_truncation(ckpt):
    # The checkpoint has decoder layers 0..3 and the MTP layer 4. With 3 decoder layers declared, the declared
    # MTP layer is layer 3, and layer 4 is neither: its tensors are unexpected (they were all skipped).
    _edit_config(ckpt, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.4\.") as error:
        hybridjit.load(ckpt)
    assert "num_hidden_layers 3 + num_nextn_predict_layers 1" in str(error.value)


def test_undeclared_mtp_layer_is_unexpected(ckpt):
    _edit_config(ckpt, num_nextn_predict_layers=0)
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.4\.embed_tokens\.weight"):
        hybridjit.load(ckpt)


def test_declared_mtp_layers_may_be_absent(ckpt):
    _edit_config(ckpt, num_nextn_predict_layers=2)  # declares layers 4 and 5; the checkpoint has only 4
    hybridjit.load(ckpt).close()


def test_fp8_weights_without_quantization_config(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="float8_e4m3 but config.json has no fp8 quantization_config"):
        hybridjit.load(ckpt)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "llama"}, "model_type 'llama' is not supported"),
        ({"topk_method": "random"}, "topk_method 'random' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"n_group": 3}, "not divisible by n_group 3"),
        ({"kv_lora_rank": None}, "required field 'kv_lora_rank' is missing"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not supported"),
    ],
)
def test_unsupported_config(ckpt, change, message):
    config = json.loads((ckpt / "config.json").read_text())
    config.update(change)
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"config.json: .*{message}"):
        hybridjit.load(ckpt)


YARN = tiny_config("v3")["rope_scaling"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # Values that used to load and then compute NaN, pick masked experts or end in a bare JAX error.
        ({"rms_norm_eps": -1}, r"rms_norm_eps must be a finite number > 0, got -1"),
        ({"rms_norm_eps": 0}, r"rms_norm_eps must be a finite number > 0, got 0"),
        ({"topk_group": 5}, r"topk_group must be an integer in 1\.\.4 \(n_group\), got 5"),
        ({"topk_group": 0}, r"topk_group must be an integer in 1\.\.4 \(n_group\), got 0"),
        ({"num_experts_per_tok": 17}, r"num_experts_per_tok must be an integer in 1\.\.16 \(n_routed_experts\)"),
        ({"topk_group": 1, "num_experts_per_tok": 5}, r"num_experts_per_tok 5 exceeds the 4 experts"),
        ({"n_group": 16, "topk_group": 8}, r"noaux_tc ranks each group by its top-2 scores"),
        ({"vocab_size": 0}, r"vocab_size must be a positive integer, got 0"),
        ({"hidden_size": -200}, r"hidden_size must be a positive integer, got -200"),
        ({"intermediate_size": 0}, r"intermediate_size must be a positive integer"),
        ({"moe_intermediate_size": 0}, r"moe_intermediate_size must be a positive integer"),
        ({"num_hidden_layers": 0}, r"num_hidden_layers must be a positive integer"),
        ({"num_attention_heads": 0}, r"num_attention_heads must be a positive integer"),
        ({"kv_lora_rank": 0}, r"kv_lora_rank must be a positive integer"),
        ({"q_lora_rank": 0}, r"q_lora_rank must be a positive integer"),
        ({"qk_nope_head_dim": 0}, r"qk_nope_head_dim must be a positive integer"),
        ({"qk_rope_head_dim": 15}, r"qk_rope_head_dim must be even \(rope rotates pairs\), got 15"),
        ({"v_head_dim": 0}, r"v_head_dim must be a positive integer"),
        ({"max_position_embeddings": 0}, r"max_position_embeddings must be a positive integer"),
        ({"n_shared_experts": -1}, r"n_shared_experts must be an integer >= 0, got -1"),
        ({"num_nextn_predict_layers": -1}, r"num_nextn_predict_layers must be an integer >= 0, got -1"),
        ({"first_k_dense_replace": 5}, r"first_k_dense_replace must be an integer in 0\.\.4 \(num_hidden_layers\)"),
        ({"first_k_dense_replace": -1}, r"first_k_dense_replace must be an integer in 0\.\.4"),
        ({"routed_scaling_factor": 0}, r"routed_scaling_factor must be a finite number > 0, got 0"),
        ({"routed_scaling_factor": float("inf")}, r"routed_scaling_factor must be a finite number > 0, got inf"),
        ({"rope_theta": 0}, r"rope_theta must be a finite number > 1"),
        ({"rope_scaling": {**YARN, "factor": 0.5}}, r"rope_scaling\.factor must be a finite number >= 1, got 0\.5"),
        ({"rope_scaling": {**YARN, "beta_fast": 0}}, r"rope_scaling\.beta_fast must be a finite number > 0"),
        (
            {"rope_scaling": {**YARN, "original_max_position_embeddings": 0}},
            r"rope_scaling\.original_max_position_embeddings must be a positive integer",
        ),
        ({"eos_token_id": 300}, r"eos_token_id must be a token id in 0\.\.299 \(vocab_size - 1\), got 300"),
        ({"bos_token_id": -1}, r"bos_token_id must be a token id in 0\.\.299"),
        # Wrong types: a string, a bool or a float where an integer belongs, a string for a flag, and so on.
        ({"hidden_size": "big"}, r"hidden_size must be an integer, got 'big'"),
        ({"num_hidden_layers": True}, r"num_hidden_layers must be an integer, got True"),
        ({"n_routed_experts": 16.5}, r"n_routed_experts must be an integer, got 16\.5"),
        ({"rms_norm_eps": "1e-6"}, r"rms_norm_eps must be a number, got '1e-6'"),
        ({"norm_topk_prob": "false"}, r"norm_topk_prob must be true or false, got 'false'"),
        ({"eos_token_id": "1"}, r"eos_token_id must be an integer or a list of integers, got '1'"),
        ({"eos_token_id": [1, "2"]}, r"eos_token_id must be an integer or a list of integers"),
        ({"topk_method": ["noaux_tc"]}, r"topk_method must be a string, got \['noaux_tc'\]"),
        ({"rope_scaling": "yarn"}, r"rope_scaling must be an object, got 'yarn'"),
        ({"quantization_config": ["fp8"]}, r"quantization_config must be an object"),
    ],
)
def test_config_values_out_of_range_or_of_the_wrong_type(ckpt, change, message):
    config = json.loads((ckpt / "config.json").read_text())
    config.update(change)
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"{ckpt / 'config.json'}: {message}"):
        hybridjit.load(ckpt)


@pytest.mark.parametrize("content", ["[1, 2]", '"config"', "null", "3"])
def test_config_not_an_object(ckpt, content):
    (ckpt / "config.json").write_text(content)
    with pytest.raises(ConfigError, match=rf"{ckpt / 'config.json'}: must hold a JSON object"):
        hybridjit.load(ckpt)


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        hybridjit.load(ckpt)


def _overwrite(ckpt, name, rows=None, byte=0xFF):
    """Overwrites a tensor's stored bytes (rows `rows` of it, default all) in its file: 0xFF bytes are NaN in
    float32, bfloat16 and float8_e4m3fn alike."""
    info = Checkpoint(ckpt).info(name)
    begin, end = info.begin, info.end
    if rows is not None:
        row_bytes = info.nbytes // info.shape[0]
        begin, end = begin + rows.start * row_bytes, begin + rows.stop * row_bytes
    with open(info.file, "r+b") as f:
        f.seek(begin)
        f.write(bytes([byte]) * (end - begin))


PROMPT = [5, 17, 42, 99, 3, 250, 7]


def test_nan_experts_raise_naming_the_model_and_the_layer(ckpt):
    for e in range(16):  # every routed expert of layer 2, so that whatever the routing, some token meets one
        _overwrite(ckpt, f"model.layers.2.mlp.experts.{e}.gate_proj.weight")
    model = hybridjit.load(ckpt)
    try:
        layer = r"are not finite \(NaN or infinity\); the first layer whose output is not finite is layer 2 \(model"
        step = rf"{ckpt}: the logits of sequence 0, new token 1, {layer}"
        with pytest.raises(NonFiniteLogitsError, match=step):
            model.generate(PROMPT, max_new_tokens=4)
        with pytest.raises(NonFiniteLogitsError, match=step):
            list(model.stream(PROMPT, max_new_tokens=4))
        with pytest.raises(NonFiniteLogitsError, match=rf"{ckpt}: the logits of sequence 0 at position \d+ {layer}"):
            model.logits([PROMPT])
    finally:
        model.close()


def test_nan_met_only_by_a_decode_step_raises_too(ckpt):
    model = hybridjit.load(ckpt)
    first = model.generate(PROMPT, max_new_tokens=1)[0]
    model.close()
    assert first not in PROMPT
    # The embedding of the first new token is NaN: prefill is finite, the decode step that reads it is not.
    _overwrite(ckpt, "model.embed_tokens.weight", rows=range(first, first + 1))
    model = hybridjit.load(ckpt)
    try:
        with pytest.raises(
            NonFiniteLogitsError,
            match=rf"{ckpt}: the logits of sequence 1, new token 2, are not finite .* the token embeddings",
        ):
            model.generate([[11, 12, 13], PROMPT], max_new_tokens=4)  # two sequences: the dual-batch decode
    finally:
        model.close()
