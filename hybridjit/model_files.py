"""Opens what a resolved model path holds, whatever its format: a Hugging Face checkpoint directory
(config.json, safetensors, tokenizer.json) or a GGUF file (metadata, tensors and tokenizer in one file or a
split set), as the config, the checkpoint the loader reads by Hugging Face names, and the tokenizer."""

from pathlib import Path

from hybridjit.checkpoint import Checkpoint
from hybridjit.gguf_checkpoint import GGUFCheckpoint
from hybridjit.gguf_file import is_gguf
from hybridjit.gguf_tokenizer import gguf_tokenizer
from hybridjit.models.registry import ModelConfig, config_from_json
from hybridjit.tokenizer import Tokenizer, load_tokenizer


def open_checkpoint(path: Path) -> tuple[ModelConfig, Checkpoint | GGUFCheckpoint]:
    if is_gguf(path):
        ckpt = GGUFCheckpoint(path)
        return ckpt.config, ckpt
    return config_from_json(path / "config.json"), Checkpoint(path)


def open_tokenizer(path: Path, config: ModelConfig, ckpt: Checkpoint | GGUFCheckpoint) -> Tokenizer | None:
    if isinstance(ckpt, GGUFCheckpoint):
        return gguf_tokenizer(ckpt.file)
    return load_tokenizer(path, config.bos_token_id)
