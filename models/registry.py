"""Model families by Hugging Face `model_type` and `architectures` (as vLLM's model registry): the one place
the runtime learns which family a checkpoint belongs to. The engine, loader, stream-loaded prefill,
conversion, synthetic checkpoints and `info` work through the family a config names and never import a
family by name.

Adding a family: a package models/<family>/ with the four modules that models/deepseek_v3/__init__.py
describes (config, model, ckpt, cost), and its name in FAMILIES below.
"""

from pathlib import Path
from types import ModuleType

from hybridjit.config import ConfigError, read_config_json
from hybridjit.models import deepseek_v3, glm4_moe, gpt_oss, minimax_m2, mixtral, qwen3_moe
from hybridjit.models.common.config import ModelConfig

FAMILIES: tuple[ModuleType, ...] = (deepseek_v3, qwen3_moe, mixtral, glm4_moe, minimax_m2, gpt_oss)

_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.config.MODEL_TYPES}
_MODEL_TYPE_BY_ARCHITECTURE = {a: t for f in FAMILIES for a, t in f.config.ARCHITECTURES.items()}
_BY_CONFIG_CLASS = {f.config.CONFIG: f for f in FAMILIES}
# Known model names -> Hugging Face repo ids, and named geometries of released sizes, over all families.
NAMES = {name: repo for f in FAMILIES for name, repo in f.config.NAMES.items()}
GEOMETRIES = {name: raw for f in FAMILIES for name, raw in f.config.PRESETS.items()}


def supported() -> str:
    return ", ".join(sorted(_BY_MODEL_TYPE))


def _with_model_type(raw: dict) -> dict:
    """raw with the model_type its architectures imply where it has none. Only then: a model_type we do not know
    is another model, whatever class it reuses."""
    architectures = raw.get("architectures")
    if raw.get("model_type") is None and isinstance(architectures, list):
        known = [_MODEL_TYPE_BY_ARCHITECTURE[a] for a in architectures if a in _MODEL_TYPE_BY_ARCHITECTURE]
        if known:
            return {**raw, "model_type": known[0]}
    return raw


def family_for_hf_config(raw: dict, source: str = "config.json") -> ModuleType:
    """The family of a config.json object, by its model_type, else by its architectures."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: must hold a JSON object of fields, got {raw!r:.60}")
    family = _BY_MODEL_TYPE.get(_with_model_type(raw).get("model_type"))
    if family is None:
        raise ConfigError(
            f"{source}: model_type {raw.get('model_type')!r} is not supported (architectures "
            f"{raw.get('architectures')}); supported model types: {supported()}"
        )
    return family


def config_from_hf(raw: dict, source: str = "config.json") -> ModelConfig:
    """The config of the family `raw` (a config.json object) belongs to."""
    return family_for_hf_config(raw, source).config.CONFIG.from_hf_config(_with_model_type(raw), source=source)


def config_from_json(path: str | Path) -> ModelConfig:
    return config_from_hf(read_config_json(path), source=str(path))


def family_of(cfg: ModelConfig) -> ModuleType:
    """The family package of a config made by config_from_hf."""
    try:
        return _BY_CONFIG_CLASS[type(cfg)]
    except KeyError:
        raise TypeError(f"{type(cfg).__name__} is not the config of a registered family ({supported()})") from None
