"""Safetensors files read and written one tensor at a time, without a memory map: a conversion or a
quantizing load holds one tensor, not the model's pages."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch

from engine.errors import ModelLoadError

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class SafetensorsFile:
    """A safetensors file read tensor by tensor (8-byte header length, JSON header, raw data), each into
    memory of its own: unlike a memory map nothing of the file stays mapped, so a process converting or
    quantizing weights as it reads them holds one tensor at a time, not the file's pages (they would
    count in its RSS)."""

    def __init__(self, file: Path):
        self.file = Path(file)
        with reading(self.file), open(self.file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            self.header = json.loads(f.read(size))
        self.header.pop("__metadata__", None)
        self.base = 8 + size

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return sorted(self.header, key=lambda n: self.header[n]["data_offsets"][0])

    def get(self, name: str, index: Optional[int] = None) -> torch.Tensor:
        """The tensor, or with `index` its index-th entry along the first dimension alone (only its bytes
        read: one expert of a stacked tensor)."""
        meta = self.header[name]
        start, end = meta["data_offsets"]
        shape = meta["shape"]
        if index is not None:
            step = (end - start) // shape[0]
            start, end, shape = start + index * step, start + (index + 1) * step, shape[1:]
        dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
        with reading(self.file), open(self.file, "rb") as f:
            if dtype is None:
                raise ValueError(f"{name} has dtype {meta['dtype']}, which this engine does not read")
            f.seek(self.base + start)
            data = bytearray(end - start)
            if f.readinto(data) != end - start:
                raise ValueError(f"{name} is cut short")
        return (torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)).view(shape)


_DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}


class SafetensorsWriter:
    """A safetensors file written one tensor at a time, so that a conversion holds one tensor, not the
    model. The header is known only at the end; it goes into room reserved before the data, padded
    with spaces (the format allows it). `entries` and `longest_name` bound what the header will hold.
    The file is created on the first tensor: a writer given none leaves no file."""

    def __init__(self, file: Path, entries: int, longest_name: int):
        self.file, self.header, self._out, self._end = Path(file), {}, None, 0
        # One entry: "name":{"dtype":"BF16","shape":[4 numbers],"data_offsets":[2 numbers]}, 20 digits a number.
        self._room = -(-(entries * (longest_name + 180) + 64) // 8) * 8

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._out is None:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            self._out = open(self.file, "wb")
            self._out.seek(8 + self._room)
        data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
        self._out.write(data)
        self.header[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                             "data_offsets": [self._end, self._end + data.nbytes]}
        self._end += data.nbytes

    def close(self) -> None:
        if self._out is None:
            return
        with self._out:
            header = json.dumps({"__metadata__": {"format": "pt"}, **self.header}, separators=(",", ":")).encode()
            if len(header) > self._room:
                raise ValueError(f"{self.file}: {len(self.header)} tensors overflow the header's reserved room")
            self._out.seek(0)
            self._out.write(self._room.to_bytes(8, "little") + header.ljust(self._room))

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextmanager
def reading(file: Path):
    """Report a corrupt weight file as a ModelLoadError naming it, not as a library exception."""
    try:
        yield
    except Exception as e:
        raise ModelLoadError(f"Cannot read weights from {file} ({e}); it may be truncated or corrupt. "
                             f"Download or convert the model again.") from e
