"""Reading a Hugging Face `config.json`: typed field access whose errors name the file and the field, and the
weight-format sections (`quantization_config`) that every family shares. Each family's own config class
(models/<family>/config.py) is built from these; models/registry.py picks the family.
"""

import dataclasses
import json
import math
from pathlib import Path


class ConfigError(ValueError):
    """A config.json this engine cannot run, with the file and the field named."""


def read_config_json(path: str | Path) -> dict:
    """The object in a config.json, with a ConfigError naming the file when it is missing or not JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json; a checkpoint directory must contain one") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e})") from None


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    block: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class IntQuantConfig:
    """Routed experts stored as int8 or int4 with a float32 scale per row and group of input columns
    (quantization_config {"quant_method": "hybridjit_int", "bits": 8 | 4, "group_size": G}; the format is
    defined in hybridjit/convert.py)."""

    bits: int
    group_size: int

    def stored_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """[out, in] as stored: int4 packs two values per byte."""
        return (shape[0], -(-shape[1] // 2)) if self.bits == 4 else shape

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        return shape[0], -(-shape[1] // self.group_size)


_REQUIRED = object()


class ConfigFields:
    """Typed reads of a config.json object's fields: each error names the file, the field and what is allowed.

    Values are never coerced (a string "12" is not the integer 12, nor "false" a false flag): a value of the
    wrong type is an error, as is a number out of its range. An absent or null field takes its default.
    """

    def __init__(self, raw, source: str, prefix: str = ""):
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: must hold a JSON object of fields, got {raw!r:.60}")
        self.raw, self.source, self.prefix = raw, source, prefix

    def error(self, key: str, allowed: str, value) -> ConfigError:
        return ConfigError(f"{self.source}: {self.prefix}{key} must be {allowed}, got {value!r}")

    def _value(self, key: str, default, kinds: tuple[type, ...], allowed: str):
        value = self.raw.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ConfigError(f"{self.source}: required field '{self.prefix}{key}' is missing")
            return None
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.error(key, allowed, value)
        return value

    def integer(self, key: str, default=_REQUIRED, minimum: int | None = None, maximum: tuple[int, str] | None = None):
        """An integer (not a bool) >= minimum and, with maximum = (bound, its field's name), <= bound."""
        value = self._value(key, default, (int,), "an integer")
        if value is None:
            return default
        if maximum is not None and not minimum <= value <= maximum[0]:
            raise self.error(key, f"an integer in {minimum}..{maximum[0]} ({maximum[1]})", value)
        if minimum is not None and value < minimum:
            raise self.error(key, "a positive integer" if minimum == 1 else f"an integer >= {minimum}", value)
        return value

    def number(self, key: str, default=_REQUIRED, *, above: float | None = None, at_least: float | None = None):
        """A finite number (int or float) > `above` or >= `at_least` when given, as float."""
        value = self._value(key, default, (int, float), "a number")
        if value is None:
            return default
        bound = f" > {above}" if above is not None else f" >= {at_least}" if at_least is not None else ""
        if (
            not math.isfinite(value)
            or (above is not None and value <= above)
            or (at_least is not None and value < at_least)
        ):
            raise self.error(key, f"a finite number{bound}", value)
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._value(key, default, (bool,), "true or false")
        return default if value is None else value

    def text(self, key: str, default: str | None) -> str | None:
        value = self._value(key, default, (str,), "a string")
        return default if value is None else value

    def section(self, key: str) -> "ConfigFields | None":
        """A nested object's fields, or None when absent."""
        value = self._value(key, None, (dict,), "an object")
        return None if value is None else ConfigFields(value, self.source, f"{self.prefix}{key}.")

    def token_id(self, key: str, vocab_size: int) -> int | None:
        value = self.integer(key, None)
        if value is not None and not 0 <= value < vocab_size:
            raise self.error(key, f"a token id in 0..{vocab_size - 1} (vocab_size - 1)", value)
        return value

    def token_ids(self, key: str, vocab_size: int) -> tuple[int, ...]:
        """An integer or a list of integers (several end-of-sequence tokens), each a token id."""
        value = self.raw.get(key)
        ids = value if isinstance(value, list) else [] if value is None else [value]
        if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
            raise self.error(key, "an integer or a list of integers", value)
        for i in ids:
            if not 0 <= i < vocab_size:
                raise self.error(key, f"a token id in 0..{vocab_size - 1} (vocab_size - 1)", i)
        return tuple(ids)


def fp8_config(f: ConfigFields) -> Fp8Config | None:
    q = f.section("quantization_config")
    # int: hybridjit's own (int_config); mxfp4: gpt-oss's experts, whose format the checkpoint map names.
    if q is None or q.raw.get("quant_method") in (INT_QUANT_METHOD, "mxfp4"):
        return None
    # DeepSeek's releases say fmt "e4m3", MiniMax-M2's "float8_e4m3fn": the same format.
    if q.raw.get("quant_method") != "fp8" or q.raw.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):
        raise ConfigError(f"{f.source}: quantization_config {q.raw} is not supported (fp8 e4m3 with block scales only)")
    block = q.raw.get("weight_block_size")
    if not isinstance(block, list) or len(block) != 2 or not all(type(b) is int and b > 0 for b in block):
        raise ConfigError(f"{f.source}: fp8 quantization_config needs weight_block_size [rows, cols], got {block!r}")
    return Fp8Config(block=(block[0], block[1]))


INT_QUANT_METHOD = "hybridjit_int"


def int_config(f: ConfigFields) -> IntQuantConfig | None:
    q = f.section("quantization_config")
    if q is None or q.raw.get("quant_method") != INT_QUANT_METHOD:
        return None
    bits, group = q.raw.get("bits"), q.raw.get("group_size")
    if bits not in (4, 8) or type(group) is not int or group <= 0 or group % 128:
        raise ConfigError(
            f"{f.source}: quantization_config {q.raw} is not supported: bits must be 8 or 4 and group_size a "
            "positive multiple of 128"
        )
    return IntQuantConfig(bits=bits, group_size=group)
