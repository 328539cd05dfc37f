"""A checkpoint's safetensors files: which files hold the weights, and an index of every
tensor in them that reads one tensor at a time.

Tensors are read with plain file reads into a fresh buffer, not through a memory map: a
mapped file's pages stay in the process's resident set until the file is closed, so loading
a bf16 checkpoint into float32 through `safe_open` peaks at the float32 model plus the whole
file. Read this way, the peak is the model plus the largest single tensor.

The format: an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from model.models.weight_map import CheckpointError

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 << 20


def weight_files(directory: Path) -> list[Path]:
    """`model.safetensors`, else the shards that `model.safetensors.index.json` lists."""
    single, index = directory / WEIGHTS_FILE, directory / INDEX_FILE
    if single.is_file():
        return [single]
    if not index.is_file():
        others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        found = f" (found {', '.join(others)}: only safetensors weights are read)" if others else ""
        raise CheckpointError(f"no weights in {directory}: expected {WEIGHTS_FILE} or {INDEX_FILE}{found}")
    try:
        weight_map = json.loads(index.read_text("utf-8")).get("weight_map")
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{index} is not a JSON object with a \"weight_map\": {e}") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no \"weight_map\"")
    files = [directory / name for name in sorted(set(weight_map.values()))]
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"weight shard {file.name} listed in {index} is missing")
    return files


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes lie."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in `file`
    end: int


def _read_header(file: Path) -> dict[str, StoredTensor]:
    with open(file, "rb") as f:
        raw = f.read(8)
        size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < size <= _MAX_HEADER:
            raise CheckpointError(f"{file} is not a safetensors file (bad header length)")
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file} is not a safetensors file: its header is not JSON ({e})") from e
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info.get("dtype") not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} in {file.name} has unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        out[name] = StoredTensor(file, _DTYPES[info["dtype"]], tuple(info["shape"]), 8 + size + begin, 8 + size + end)
    return out


class TensorIndex:
    """Every tensor of a checkpoint's files by name; reads them one at a time."""

    def __init__(self, files: list[Path]) -> None:
        self.tensors: dict[str, StoredTensor] = {}
        for file in files:
            for name, stored in _read_header(file).items():
                if name in self.tensors:
                    raise CheckpointError(f"tensor {name!r} appears in more than one weight file ({file.name})")
                self.tensors[name] = stored

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor, in its stored dtype, in a buffer of its own (no memory map)."""
        t = self.tensors[name]
        itemsize = torch.empty((), dtype=t.dtype).element_size()
        if t.end - t.begin != math.prod(t.shape) * itemsize:
            raise CheckpointError(f"tensor {name!r} in {t.file.name}: {t.end - t.begin} bytes do not hold "
                                  f"shape {list(t.shape)} of {t.dtype}")
        out = torch.empty(t.shape, dtype=t.dtype)
        buf = out.view(-1).view(torch.uint8).numpy() if out.numel() else bytearray()
        with open(t.file, "rb") as f:
            f.seek(t.begin)
            if f.readinto(buf) != t.end - t.begin:
                raise CheckpointError(f"{t.file} is truncated: tensor {name!r} runs past its end")
        return out
