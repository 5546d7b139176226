"""Two of GGUF's block formats, read by hand: Q8_0 and Q4_1 (chapter 09; lab 09's exercise).

llama.cpp stores a quantised weight matrix row by row, each row cut into blocks of 32 weights
along its input dimension K, each block self-contained (``ggml-common.h``, ``block_q8_0`` and
``block_q4_1``; ``gguf.quants`` in the ``gguf`` package reads them the same way). Every number is
little-endian:

* **Q8_0**, 34 bytes per block: ``d``, a float16 scale (2 bytes), then 32 signed int8 codes ``q``.
  Weight ``i`` is ``d * q[i]``.
* **Q4_1**, 20 bytes per block: ``d``, a float16 scale, ``m``, a float16 minimum, then 16 bytes of
  4-bit unsigned codes (0 .. 15). Byte ``j`` holds weight ``j`` in its **low** nibble and weight
  ``j + 16`` in its **high** nibble (not the neighbours ``2j`` and ``2j + 1``). Weight ``i`` is
  ``d * q[i] + m``: an asymmetric grid of 16 levels from ``m`` to ``m + 15 d``.

The functions take a tensor's raw bytes as ``gguf.GGUFReader`` maps them, ``(rows, bytes per
row)`` uint8, and return float32 ``(rows, weights per row)``. :func:`gguf_rows` reads some rows of
a tensor of a GGUF file that way, from the file's tensor table (:func:`tensor_table`) without
parsing the rest of its metadata (the shipped SmolLM2 file holds both types: its token embedding is
Q8_0, its projections Q4_1).
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ._answers import answer

__all__ = ["BLOCK", "BLOCK_BYTES", "dequantize_q8_0", "dequantize_q4_1", "TensorEntry", "tensor_table", "gguf_rows",
           "reference_dequantize"]

BLOCK = 32  # weights per block, both types
BLOCK_BYTES = {"Q8_0": 2 + 32, "Q4_1": 2 + 2 + 16}


def _blocks(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """``raw`` (rows, bytes) uint8 as (rows, blocks, bytes per block); ValueError naming what is wrong."""
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 2:
        got = f"{raw.dtype} {tuple(raw.shape)}" if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise ValueError(f"raw must be a 2-D uint8 tensor (rows, bytes per row), got {got}")
    size = BLOCK_BYTES[kind]
    if raw.shape[1] % size:
        raise ValueError(f"a {kind} row is a whole number of {size}-byte blocks; {raw.shape[1]} bytes is not")
    return raw.contiguous().reshape(raw.shape[0], raw.shape[1] // size, size)


def _f16(two_bytes: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8, little-endian float16 bits -> (...) float32."""
    return two_bytes.contiguous().view(torch.float16)[..., 0].float()


@answer
def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (rows, 34 * blocks) uint8 -> float32 (rows, 32 * blocks): ``d * q``."""
    b = _blocks(raw, "Q8_0")  # (rows, blocks, 34)
    d = _f16(b[..., 0:2])  # (rows, blocks)
    q = b[..., 2:].contiguous().view(torch.int8).float()  # (rows, blocks, 32)
    return (d[..., None] * q).reshape(raw.shape[0], -1)


@answer
def dequantize_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks (rows, 20 * blocks) uint8 -> float32 (rows, 32 * blocks): ``d * q + m``, weight
    ``j`` in the low nibble of byte ``j`` and weight ``j + 16`` in its high nibble."""
    b = _blocks(raw, "Q4_1")  # (rows, blocks, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (rows, blocks)
    qs = b[..., 4:].to(torch.int16)  # (rows, blocks, 16)
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).float()  # (rows, blocks, 32): low nibbles, then high
    return (d[..., None] * q + m[..., None]).reshape(raw.shape[0], -1)


def reference_dequantize(raw: np.ndarray | torch.Tensor, kind: str) -> torch.Tensor:
    """The ``gguf`` package's own reading of the same bytes (``gguf.quants.dequantize``), float32
    (rows, weights): what the check compares a learner's function with."""
    import gguf  # an optional dependency (labsupport[model]): only checks and tests call this

    data = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    values = gguf.quants.dequantize(np.ascontiguousarray(data, dtype=np.uint8),
                                    getattr(gguf.GGMLQuantizationType, kind))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(data.shape[0], -1))


# --- finding a tensor's rows without parsing the whole file -----------------------------------------
#
# gguf.GGUFReader parses every metadata field, the tokenizer's 49,152 tokens and 48,900 merges
# included, into numpy views: a minute on a busy 2-core machine. To read a few rows only the tensor
# table is needed: the header (magic "GGUF", version, tensor count, metadata count), the metadata
# skipped value by value, then each tensor's name, dimensions (fastest-varying first), type and
# offset from the aligned start of the data (GGUF v2/v3, little-endian; ggml's docs/gguf.md).

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a GGUF file's table: ``dims`` fastest-varying first (as GGUF writes them),
    ``type_name`` (``"Q4_1"``...), ``row_bytes`` (bytes of one row of ``dims[0]`` weights) and
    ``offset`` (absolute, in the file)."""

    name: str
    dims: tuple[int, ...]
    type_name: str
    row_bytes: int
    offset: int

    @property
    def rows(self) -> int:
        return math.prod(self.dims[1:])


def _skip_value(buf: bytes, pos: int, kind: int) -> int:
    if kind in _SCALAR_BYTES:
        return pos + _SCALAR_BYTES[kind]
    if kind == _STRING:
        (n,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + n
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if item in _SCALAR_BYTES:
            return pos + count * _SCALAR_BYTES[item]
        for _ in range(count):
            pos = _skip_value(buf, pos, item)
        return pos
    raise ValueError(f"unknown GGUF value type {kind} at byte {pos}: the file is damaged or not GGUF v2/v3")


@functools.lru_cache(maxsize=4)
def tensor_table(path: Path | str) -> dict[str, TensorEntry]:
    """The tensor table of the GGUF file ``path``: name -> :class:`TensorEntry` (see above)."""
    import gguf  # for the block sizes of every type (gguf.GGML_QUANT_SIZES)

    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF version {version}; only versions 2 and 3 are read here")
        size, buf = 1 << 22, head
        while True:  # the metadata and the table fit in the first few MB; read more if not
            buf += f.read(size)
            try:
                return _parse_table(path, buf, n_tensors, n_kv, gguf)
            except struct.error:
                if len(buf) >= path.stat().st_size:
                    raise ValueError(f"{path} ends inside its own tensor table: the file is truncated") from None
                size *= 2


def _parse_table(path, buf: bytes, n_tensors: int, n_kv: int, gguf) -> dict[str, TensorEntry]:
    pos, alignment = 24, 32
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", buf, pos)
        key = buf[pos + 8:pos + 8 + n].decode("utf-8")
        pos += 8 + n
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", buf, pos)
        pos = _skip_value(buf, pos, kind)
    infos = []
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", buf, pos)
        name = buf[pos + 8:pos + 8 + n].decode("utf-8")
        pos += 8 + n
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        pos += 4 + 8 * n_dims
        kind, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        infos.append((name, tuple(int(x) for x in dims), kind, offset))
    if pos > len(buf):
        raise struct.error("short")
    start = (pos + alignment - 1) // alignment * alignment
    table = {}
    for name, dims, kind, offset in infos:
        qtype = gguf.GGMLQuantizationType(kind)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        table[name] = TensorEntry(name, dims, qtype.name, dims[0] // block * block_bytes, start + offset)
    return table


def gguf_rows(path: Path | str, tensor: str, rows: Sequence[int]) -> tuple[torch.Tensor, str]:
    """Rows ``rows`` of ``tensor`` in the GGUF file ``path`` as raw bytes, (len(rows), bytes per row)
    uint8, and the tensor's type name (``"Q4_1"``...). Only the file's table and those rows are read."""
    table = tensor_table(path)
    entry = table.get(tensor)
    if entry is None:
        raise ValueError(f"{path} has no tensor {tensor!r}")
    bad = [r for r in rows if not 0 <= int(r) < entry.rows]
    if bad:
        raise ValueError(f"{tensor} has {entry.rows} rows; rows {bad} are out of range")
    out = np.empty((len(rows), entry.row_bytes), dtype=np.uint8)
    with open(path, "rb") as f:
        for i, r in enumerate(rows):
            f.seek(entry.offset + int(r) * entry.row_bytes)
            chunk = f.read(entry.row_bytes)
            if len(chunk) != entry.row_bytes:
                raise ValueError(f"{path} ends inside row {r} of {tensor}: the file is truncated")
            out[i] = np.frombuffer(chunk, dtype=np.uint8)
    return torch.from_numpy(out), entry.type_name
