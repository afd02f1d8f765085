"""A bank file's rows read a bounded chunk at a time, for a reader that
visits every row once (kvfill-check's value statistics): ``Bank.load``
holds the whole bank in memory, this holds one chunk.

Rows are read with plain reads at the offsets the safetensors header names,
not through a mapping of the file: the pages of a mapped file count in the
reading process's resident memory for as long as it stays mapped, so
reading a 40 GiB bank through ``safe_open`` would show 40 GiB resident.
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Iterator

import torch

from . import files
from .format import BankError
from .state import layouts_from_json, state_tensor_name

# safetensors' dtype names (its header) -> torch's; a name missing here is a dtype this reader does not decode.
_TORCH_DTYPE = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
CHUNK_ELEMENTS = 1 << 19  # rows per read: this many elements at most (one row at least)


@dataclasses.dataclass(frozen=True)
class StoredLayer:
    """One row layer of a bank file, as its header and metadata describe it:
    ``rows`` x ``row`` elements of ``dtype`` from byte ``offset`` of the file;
    ``value_dtype`` the float dtype its bytes encode as the metadata names it
    (``""``: the storage dtype's own); ``kv`` ``(num_kv_heads, head_size,
    head_size_v)`` of a canonical row, None for a layer in its cache's own order."""

    name: str
    dtype: torch.dtype | None  # None: a safetensors dtype this reader has no torch dtype for
    value_dtype: str
    kv: tuple[int, int, int] | None
    rows: int
    row: int
    offset: int

    @property
    def values(self) -> torch.dtype | None:
        """The float dtype the stored bytes decode to, element for element
        (a ``uint8`` fp8 cache's ``float8_e4m3fn``); None for bytes that are
        no float values of one element each (packed rows with their scales,
        integers)."""
        if self.dtype is None:
            return None
        named = getattr(torch, self.value_dtype, None) if self.value_dtype else self.dtype
        if not isinstance(named, torch.dtype) or not named.is_floating_point:
            return None
        return named if named.itemsize == self.dtype.itemsize else None


@dataclasses.dataclass(frozen=True)
class StoredBank:
    """What a bank file's header says of it, no row read: its row layers in
    file order, its provenance metadata (``model``, ``kv_cache_dtype``, ...),
    how many sequences it holds and whether it holds recurrent state."""

    path: str
    layers: dict[str, StoredLayer]
    metadata: dict[str, str]
    num_sequences: int
    has_state: bool


def read_stored(path: str | os.PathLike) -> StoredBank:
    """A bank file's header, checked as ``Bank.load`` checks it (format,
    version, identity, every tensor's shape against the metadata); BankError
    naming the file and what is wrong."""
    path = os.fspath(path)
    num_sequences, _, _, _ = files.read_index(path)  # format, version, identity and shapes checked
    header, data_start = _header(path)
    meta = header.get("__metadata__") or {}
    info = files.layers_info(meta, path)
    states = layouts_from_json(meta.get("states"), path)
    state_names = {state_tensor_name(n, i) for n, layout in states.items() for i in range(len(layout))}
    layers = {}
    for name, entry in header.items():
        if name == "__metadata__" or name in state_names:
            continue
        begin, _ = entry["data_offsets"]
        rows, row = entry["shape"]  # [rows, row]: files.read_index checked it
        v = info.get(name) or {}
        kv = v.get("kv")
        layers[name] = StoredLayer(name, _TORCH_DTYPE.get(entry["dtype"]), str(v.get("value_dtype") or ""),
                                   tuple(kv) if kv else None, rows, row, data_start + begin)
    layers = dict(sorted(layers.items(), key=lambda item: item[1].offset))
    provenance = {k: v for k, v in meta.items() if k not in files._RESERVED_META}
    return StoredBank(path, layers, provenance, num_sequences, bool(states))


def row_chunks(path: str | os.PathLike, layer: StoredLayer,
               max_elements: int | None = None) -> Iterator[torch.Tensor]:
    """``layer``'s rows in file order, ``[n, row]`` of its storage dtype, at
    most ``max_elements`` (default ``CHUNK_ELEMENTS``; one row at least) at a time.  Every chunk is a
    view of one buffer the next read overwrites: use it before asking for
    the next.  BankError when the file ends early (truncated after its
    header was read)."""
    if layer.dtype is None:
        raise BankError(f"{path}: layer {layer.name!r} is stored in a dtype this reader does not decode")
    per_read = max(1, (max_elements or CHUNK_ELEMENTS) // layer.row)
    row_bytes = layer.row * layer.dtype.itemsize
    buffer = torch.empty(min(per_read, layer.rows) * row_bytes, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as f:
        f.seek(layer.offset)
        for start in range(0, layer.rows, per_read):
            n = min(per_read, layer.rows - start)
            chunk = buffer[:n * row_bytes]
            view, got = memoryview(chunk.numpy()), 0
            while got < len(view):
                read = f.readinto(view[got:])
                if not read:
                    raise BankError(f"{path}: ends inside layer {layer.name!r} (row {start + got // row_bytes} of "
                                    f"{layer.rows}); the file was cut short after it was written - record or copy "
                                    f"it again")
                got += read
            yield chunk.view(layer.dtype).view(n, layer.row)


def _header(path: str) -> tuple[dict, int]:
    """A safetensors file's header (its JSON) and the offset its data starts at."""
    with open(path, "rb") as f:
        size = f.read(8)
        if len(size) != 8:
            raise BankError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", size)
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise BankError(f"{path}: its safetensors header is not JSON ({exc})") from None
    return header, 8 + n
