"""Zero-copy access to a Hugging Face safetensors checkpoint (one file or many with an index).

The safetensors library reads tensors into new buffers; the routed experts must instead stay where they
are (one resident copy in host memory, shared later by the CPU kernels and the GPU streaming), so this
module maps each file once and hands out read-only numpy views into the mapping. The header format is
the documented one: 8-byte little-endian header length, a JSON header, then the raw tensor bytes.
Every inconsistency is reported with the file and tensor it concerns.
"""

import dataclasses
import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as it is, naming the file and tensor concerned."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # safetensors dtype code, e.g. "BF16", "F8_E4M3"
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Parses and checks one safetensors file's header against the file's size."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{file}: truncated or not a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{file}: corrupt header length {header_len} for a file of {size} bytes")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: corrupt safetensors header ({e})") from None
    data_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {name}: malformed header entry {entry}") from None
        if dtype not in DTYPES:
            raise CheckpointError(f"{file}: tensor {name}: dtype {dtype} is not supported")
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != expected:
            raise CheckpointError(
                f"{file}: tensor {name}: {end - begin} bytes stored for shape {list(shape)} {dtype} "
                f"(expected {expected})"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{file}: truncated: tensor {name} ends at byte {data_start + end} but the file has {size} bytes"
            )
        tensors[name] = TensorInfo(name, file, dtype, shape, data_start + begin, data_start + end)
    return tensors


class Checkpoint:
    """The tensors of a checkpoint directory, by name, as memory-mapped read-only numpy views."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a directory")
        self.tensors: dict[str, TensorInfo] = {}
        for file, expected_names in self._files().items():
            found = read_header(file)
            missing = expected_names - found.keys()
            if missing:
                raise CheckpointError(
                    f"{self.directory / INDEX_FILE} maps {sorted(missing)[:3]} to {file.name}, which lacks them"
                )
            for name, info in found.items():
                if name in self.tensors:
                    raise CheckpointError(
                        f"tensor {name} is stored twice: {self.tensors[name].file} and {file}"
                    )
                self.tensors[name] = info
        self._maps: dict[Path, np.memmap] = {}

    def _files(self) -> dict[Path, set[str]]:
        """Each safetensors file with the tensor names the index promises it holds."""
        index = self.directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            files: dict[Path, set[str]] = {}
            for name, file_name in weight_map.items():
                files.setdefault(self.directory / file_name, set()).add(name)
            for file in files:
                if not file.exists():
                    raise CheckpointError(
                        f"{index} names {file.name}, which does not exist in {self.directory}"
                    )
            return files
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.directory}: no *.safetensors files")
        return {f: set() for f in files}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.directory}: tensor {name} is missing") from None

    def get(self, name: str) -> np.ndarray:
        """A read-only view of the tensor's bytes in the mapped file (no copy)."""
        info = self.info(name)
        mapping = self._maps.get(info.file)
        if mapping is None:
            mapping = self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        return mapping[info.begin : info.end].view(DTYPES[info.dtype]).reshape(info.shape)

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())
