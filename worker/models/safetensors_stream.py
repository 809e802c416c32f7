"""A safetensors file read tensor by tensor while it downloads (sources/arriving.py).

The same calls the loader makes on `safetensors.safe_open` (keys, get_tensor, get_slice), over a
file whose bytes arrive by range: the header is read once its bytes are in, and each tensor once
its own bytes are. Keys come in the order of their data in the file, the order the download
brings them, so the loader's reads follow the download instead of waiting on its last range.

The format: 8 bytes little-endian header length N, N bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the data; offsets count from the end
of the header, and every tensor is stored C-contiguous, little-endian.
"""

from __future__ import annotations

import json
import struct

import torch

from ferry.worker.models.errors import ModelSourceError
from ferry.worker.models.sources.arriving import ArrivingFile

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER_BYTES = 100 << 20  # as the safetensors library: a larger header is a corrupt file


class ArrivingSafetensors:
    """safe_open's reading calls over an ArrivingFile."""

    def __init__(self, file: ArrivingFile) -> None:
        self.file = file
        name = file.final.name
        if file.size < 8:
            raise ModelSourceError(f"{name} is not a safetensors file: {file.size} bytes")
        (header_bytes,) = struct.unpack("<Q", file.read(0, 8))
        if header_bytes > min(_MAX_HEADER_BYTES, file.size - 8):
            raise ModelSourceError(f"{name} is not a safetensors file: a header of {header_bytes} bytes")
        try:
            header = json.loads(file.read(8, 8 + header_bytes))
        except ValueError as exc:
            raise ModelSourceError(f"{name} is not a safetensors file: its header is not JSON ({exc})") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + header_bytes
        self._entries = dict(sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]))
        for key, entry in self._entries.items():
            self._check(key, entry)

    def keys(self) -> list[str]:
        """Tensor names, in the order of their bytes in the file."""
        return list(self._entries)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, once its bytes have arrived."""
        entry = self._entries[name]
        dtype, shape = DTYPES[entry["dtype"]], entry["shape"]
        begin, end = entry["data_offsets"]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        data = self.file.read(self._data_start + begin, self._data_start + end)
        return torch.frombuffer(data, dtype=dtype).view(shape)

    def get_slice(self, name: str) -> torch.Tensor:
        """The tensor, to be indexed like safe_open's slice (`[rows, cols]`): read whole, as every
        byte of the file comes anyway."""
        return self.get_tensor(name)

    def __enter__(self) -> ArrivingSafetensors:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def _check(self, key: str, entry: dict) -> None:
        name = self.file.final.name
        if entry.get("dtype") not in DTYPES:
            raise ModelSourceError(f"{name}: tensor {key!r} has a dtype Ferry does not read: {entry.get('dtype')!r}")
        begin, end = entry["data_offsets"]
        numel = 1
        for dim in entry["shape"]:
            numel *= dim
        size = numel * DTYPES[entry["dtype"]].itemsize
        if end - begin != size or begin < 0 or self._data_start + end > self.file.size:
            raise ModelSourceError(f"{name}: tensor {key!r} has data offsets {begin}-{end} that do not hold "
                                   f"its shape {entry['shape']} of {entry['dtype']}")
