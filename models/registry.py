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
from hybridjit.models import deepseek_v3, qwen3_moe
from hybridjit.models.common.config import ModelConfig

FAMILIES: tuple[ModuleType, ...] = (deepseek_v3, qwen3_moe)

_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.config.MODEL_TYPES}
_BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.config.ARCHITECTURES}
_BY_CONFIG_CLASS = {f.config.CONFIG: f for f in FAMILIES}
# Known model names -> Hugging Face repo ids, and named geometries of released sizes, over all families.
NAMES = {name: repo for f in FAMILIES for name, repo in f.config.NAMES.items()}
GEOMETRIES = {name: raw for f in FAMILIES for name, raw in f.config.PRESETS.items()}


def supported() -> str:
    return ", ".join(sorted(_BY_MODEL_TYPE))


def family_for_hf_config(raw: dict, source: str = "config.json") -> ModuleType:
    """The family of a config.json object, by its model_type, else by its architectures."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: must hold a JSON object of fields, got {raw!r:.60}")
    family = _BY_MODEL_TYPE.get(raw.get("model_type"))
    architectures = raw.get("architectures")
    for architecture in architectures if family is None and isinstance(architectures, list) else []:
        family = family or _BY_ARCHITECTURE.get(architecture)
    if family is None:
        raise ConfigError(
            f"{source}: model_type {raw.get('model_type')!r} (architectures {raw.get('architectures')}) is not "
            f"supported; supported model types: {supported()}"
        )
    return family


def config_from_hf(raw: dict, source: str = "config.json") -> ModelConfig:
    """The config of the family `raw` (a config.json object) belongs to."""
    return family_for_hf_config(raw, source).config.CONFIG.from_hf_config(raw, source=source)


def config_from_json(path: str | Path) -> ModelConfig:
    return config_from_hf(read_config_json(path), source=str(path))


def family_of(cfg: ModelConfig) -> ModuleType:
    """The family package of a config made by config_from_hf."""
    try:
        return _BY_CONFIG_CLASS[type(cfg)]
    except KeyError:
        raise TypeError(f"{type(cfg).__name__} is not the config of a registered family ({supported()})") from None
