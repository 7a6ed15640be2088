"""The metadata and tensor index of a GGUF model file (llama.cpp's format), split sets included.

`gguf.GGUFReader` parses each file; the tensor bytes stay in its read-only memory mapping. A split set
(`<name>-00001-of-00003.gguf` ...) is opened from any of its parts: every part must be there, and the
metadata is the first part's (llama.cpp's gguf-split writes the model's keys there). Every problem is one
GGUFError naming the file and, where there is one, the tensor.
"""

import dataclasses
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from hybridjit.checkpoint import CheckpointError

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(CheckpointError):
    """A GGUF file that cannot be read as it is, naming the file and tensor concerned."""


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the set: numpy-order shape (ggml's reversed), its type and where its bytes are."""

    name: str
    file: Path
    type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 view of the tensor's bytes in the mapped file

    @property
    def nbytes(self) -> int:
        return self.data.size

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of shape[-1] elements (whole blocks: ggml rows always are)."""
        block, block_bytes = gguf.GGML_QUANT_SIZES[self.type]
        return self.shape[-1] // block * block_bytes


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf"


def split_parts(path: Path) -> list[Path]:
    """The files of path's split set in order (path alone if it is not a part of one); raises if a part is
    missing."""
    m = _SPLIT.match(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(f"{path}: split set of {count} files lacks {', '.join(missing)} (in {path.parent})")
    return parts


def _plain(value: Any) -> Any:
    """A metadata value with numpy scalars as Python ones (the config readers take Python ints and floats)."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value


class _Reader(gguf.GGUFReader):
    """GGUFReader that names a tensor whose bytes run past the end of its file: the reader maps every tensor
    as it opens the file, and its own error for a short one is numpy's reshape error, naming nothing. The
    check runs in its private `_build_tensors` step (gguf 0.19); should a release rename that, a short file
    is still refused, by _read's generic error."""

    def __init__(self, file: Path):
        self.file = file
        super().__init__(file)

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_type[0])]
            end = int(start_offs + offset[0]) + int(np.prod(dims)) * block_bytes // block
            if end > self.data.size:
                raise GGUFError(
                    f"{self.file}: truncated: tensor {bytes(name).decode()} ends at byte {end} "
                    f"but the file has {self.data.size} bytes"
                )
        super()._build_tensors(start_offs, fields)


def _read(file: Path) -> gguf.GGUFReader:
    try:
        return _Reader(file)
    except GGUFError:
        raise
    except (ValueError, IndexError, KeyError, OSError) as e:
        size = file.stat().st_size if file.exists() else 0
        raise GGUFError(f"{file}: not a readable GGUF file ({size} bytes; {e})") from None


class GGUFFile:
    """Metadata (key -> Python value) and tensors (GGUF name -> GGUFTensor) of one GGUF model, over its parts."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        self.parts = split_parts(self.path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        for i, file in enumerate(self.parts):
            reader = _read(file)
            if i == 0:
                self.metadata = {k: _plain(f.contents()) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
            self._add_tensors(file, reader)
        if "general.architecture" not in self.metadata:
            raise GGUFError(f"{self.parts[0]}: no general.architecture key: not a llama.cpp model file")

    def _add_tensors(self, file: Path, reader: gguf.GGUFReader) -> None:
        for t in reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if t.name in self.tensors:
                raise GGUFError(f"tensor {t.name} is stored twice: {self.tensors[t.name].file} and {file}")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            data = reader.data[int(t.data_offset) : end]
            self.tensors[t.name] = GGUFTensor(t.name, file, gguf.GGMLQuantizationType(t.tensor_type), shape, data)

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def key(self, name: str, default: Any = KeyError) -> Any:
        """Metadata `name`, with "{arch}" standing for the architecture; `default` if absent (KeyError: required)."""
        key = name.format(arch=self.architecture)
        if key in self.metadata:
            return self.metadata[key]
        if default is KeyError:
            raise GGUFError(f"{self.parts[0]}: metadata key {key} is missing")
        return default

    def tensor(self, name: str) -> GGUFTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: tensor {name} is missing") from None
