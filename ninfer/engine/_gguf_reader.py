"""Reading a GGUF container: its metadata and tensor table, and memory-mapped views of
the tensor data.

The `gguf` package's `GGUFReader` builds a numpy view for every part of every metadata
value: on SmolLM2's file (98,000 vocabulary strings and merges) that takes 4.6 s of a
6.4 s load on a 2-core machine. This reads the same container in one pass over the
header with `struct` and `numpy.frombuffer` (about 0.1 s). The format is GGUF v2/v3,
little-endian (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md); the `gguf`
package still provides the type constants, and the tests check this reader against
`GGUFReader` field by field and tensor by tensor.
"""

from __future__ import annotations

import struct
from typing import Any

import attrs
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

__all__ = ["GGUFTensor", "read_gguf"]

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_SCALARS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip


@attrs.frozen
class GGUFTensor:
    """One tensor of the file: what ninfer reads of `gguf.ReaderTensor`, by the same
    names. `shape` lists dimensions innermost first, as GGUF does; `data` is a
    copy-on-write view of the file (writable for torch; the file is never written)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    data: np.ndarray


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.at = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = bytes(self.buf[self.at : self.at + n])
        if len(raw) != n:
            raise ValueError("a string runs past the end of the file")
        self.at += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: GGUFValueType) -> Any:
        if kind == GGUFValueType.STRING:
            return self.string()
        if kind == GGUFValueType.ARRAY:
            item = GGUFValueType(self.unpack("<I"))
            count = self.unpack("<Q")
            if item in _SCALARS and item != GGUFValueType.BOOL:
                dtype = np.dtype(_SCALARS[item])
                values = np.frombuffer(self.buf, dtype, count, self.at)
                self.at += dtype.itemsize * count
                return values.tolist()
            return [self.value(item) for _ in range(count)]
        return self.unpack(_SCALARS[kind])


def read_gguf(path: str) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """The file's metadata (key -> Python value) and tensors, in file order. Raises
    ValueError (or struct.error) on a file that is not a readable GGUF."""
    data = np.memmap(path, dtype=np.uint8, mode="c")
    cur = _Cursor(memoryview(data))  # type: ignore[arg-type]  # numpy arrays are buffers
    if bytes(cur.buf[:4]) != _MAGIC:
        raise ValueError("no GGUF magic at the start of the file")
    cur.at = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (or a big-endian file) is not read here")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(GGUFValueType(cur.unpack("<I")))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        kind = GGMLQuantizationType(cur.unpack("<I"))
        infos.append((name, dims, kind, cur.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    start = -(-cur.at // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        n = int(np.prod(dims, dtype=np.int64))
        block, size = GGML_QUANT_SIZES[kind]
        nbytes = n // block * size
        begin = start + offset
        if begin + nbytes > len(data):
            raise ValueError(f"tensor {name} runs past the end of the file")
        rows = [int(d) for d in reversed(dims)]
        view: np.ndarray = data[begin : begin + nbytes].view(np.uint8)
        # As GGUFReader shapes it: float types by element, quantized ones by row of bytes.
        if kind == GGMLQuantizationType.F32:
            view = view.view(np.float32).reshape(rows)
        elif kind == GGMLQuantizationType.F16:
            view = view.view(np.float16).reshape(rows)
        else:
            view = view.reshape([*rows[:-1], rows[-1] // block * size])
        shape = np.array(dims, dtype=np.uint64)
        tensors.append(GGUFTensor(name, kind, shape, n, view))
    return metadata, tensors
