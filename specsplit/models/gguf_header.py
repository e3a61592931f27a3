"""What the native loader reads of a GGUF file: its scalar metadata and its tensors (name, block
type, shape, where their bytes lie), without decoding the metadata's arrays.

gguf.GGUFReader builds a numpy view for every value of every array, so the tokenizer's ~100,000
strings cost it 1.9-3.8 s of a 14.5 s model load (SmolLM2-135M on the Xeon, one thread); here an
array of strings is skipped by reading each length once, and an array of numbers in one step
(the whole file's header: 13 ms).

GGUF (v2 and v3; little-endian):
    header    magic "GGUF", uint32 version, uint64 tensor count, uint64 metadata count
    metadata  per entry: string key, uint32 value type, value (a string is uint64 length + UTF-8;
              an array is uint32 element type, uint64 count, the elements)
    tensors   per tensor: string name, uint32 n_dims, uint64 dims (ne[0], the row length, first),
              uint32 ggml type, uint64 offset from the data section
    data      at the next multiple of `general.alignment` (32 by default) after the tensor infos
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands (names the file and what is wrong)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: str  # the ggml type's name: "Q4_1", "Q8_0", "F32", ...
    dims: tuple[int, ...]  # GGUF order: ne[0] (the length of a row) first
    offset: int  # of its first byte, from the start of the file
    nbytes: int

    @property
    def rows(self) -> int:  # rows of ne[0] values (a 2-d weight: its output features)
        return int(np.prod(self.dims[1:], dtype=np.int64)) if len(self.dims) > 1 else 1


class GGUFHeader:
    """The metadata (`metadata`: key -> int / float / bool / str; arrays as None) and the tensors
    (`tensors`: name -> TensorInfo) of one file; `data(info)` its bytes [rows, row bytes] (uint8,
    read-only, memory-mapped)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 4:
            raise GGUFFormatError(f"{self.path}: not a GGUF file ({size} bytes)")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)
        self._pos = 0
        try:
            self._parse()
        except struct.error as e:  # a read past the end
            raise GGUFFormatError(f"{self.path}: the GGUF header ends early at byte {self._pos} ({e})") from None

    def data(self, info: TensorInfo) -> np.ndarray:  # [rows, row bytes] uint8, read-only
        return self._map[info.offset:info.offset + info.nbytes].reshape(info.rows, -1)

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != MAGIC:
            raise GGUFFormatError(f"{self.path}: not a GGUF file (starts with {bytes(self._buf[:4])!r}, not {MAGIC!r})")
        self._pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            raise GGUFFormatError(f"{self.path}: " + ("a big-endian GGUF file; this reader reads little-endian ones"
                                                      if swapped in (2, 3) else
                                                      f"GGUF version {version}; this reader reads versions 2 and 3"))
        n_tensors, n_meta = self._scalar("<Q"), self._scalar("<Q")
        self.metadata: dict[str, int | float | bool | str | None] = {}
        for _ in range(n_meta):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"), key)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
            infos.append((name, dims, self._scalar("<I"), self._scalar("<Q")))
        alignment = self.metadata.get("general.alignment") or DEFAULT_ALIGNMENT
        start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, code, offset in infos:
            try:
                qtype = GGMLQuantizationType(code)
            except ValueError:
                raise GGUFFormatError(f"{self.path}: tensor {name!r} has ggml type {code}, which gguf does not know") from None
            block, size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims, dtype=np.int64))
            info = TensorInfo(name, qtype.name, dims, start + offset, n // block * size)
            if n % block or dims and dims[0] % block:
                raise GGUFFormatError(f"{self.path}: tensor {name!r} {dims} is not whole {qtype.name} blocks of {block}")
            if info.offset + info.nbytes > len(self._map):
                raise GGUFFormatError(f"{self.path}: tensor {name!r} ends at byte {info.offset + info.nbytes}, "
                                      f"past the file's {len(self._map)}")
            self.tensors[name] = info

    def _scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar("<Q")
        if self._pos + n > len(self._buf):
            raise GGUFFormatError(f"{self.path}: a string of {n} bytes at byte {self._pos} runs past the end")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int, key: str):
        if vtype in SCALARS:
            return self._scalar(SCALARS[vtype])
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            self._skip_array(self._scalar("<I"), self._scalar("<Q"), key)
            return None
        raise GGUFFormatError(f"{self.path}: metadata {key!r} has value type {vtype}, which GGUF does not define")

    def _skip_array(self, etype: int, count: int, key: str) -> None:
        if etype in SCALARS:
            self._pos += count * struct.calcsize(SCALARS[etype])
        elif etype == STRING:
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", self._buf, self._pos)
                self._pos += 8 + n
        elif etype == ARRAY:
            for _ in range(count):
                self._skip_array(self._scalar("<I"), self._scalar("<Q"), key)
        else:
            raise GGUFFormatError(f"{self.path}: metadata {key!r} is an array of value type {etype}, which GGUF does not define")
        if self._pos > len(self._buf):
            raise GGUFFormatError(f"{self.path}: metadata {key!r} runs past the end of the file")
