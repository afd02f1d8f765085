"""A bank file on disk (the schema is in ``bank.py``): its metadata read and
checked against the file's tensors before any row is read, the rows loaded
into memory this process owns, and the file written atomically.  Every
problem is a ``BankError`` naming the file, the key and what was expected.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Mapping

import torch

BANK_FORMAT = "kvfill-bank"
BANK_VERSION = "2"
_RESERVED_META = ("format", "version", "num_sequences", "num_positions", "sequence_tokens", "layers")


class BankError(ValueError):
    """A bank that cannot be used: names the file or layer, what was found and what was expected."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read_index(path: str) -> tuple[int, int, list]:
    """``(num_sequences, num_positions, sequence_tokens)`` of a bank file,
    from its metadata, checked against the file's tensors (header only)."""
    return _index_of(_read_metadata(path), path)


def _index_of(meta: Mapping[str, str], path: str) -> tuple[int, int, list]:
    num_sequences = _meta_int(meta, "num_sequences", path)
    num_positions = _meta_int(meta, "num_positions", path)
    _check_shapes(path, num_sequences, num_positions)
    return num_sequences, num_positions, _meta_tokens(meta, path, num_sequences, num_positions)


def load(path: str) -> dict:
    """The keyword arguments of ``Bank(...)`` for a bank file, its rows read
    into memory this process owns (not a mapping of the file: rewriting or
    truncating it later changes nothing here)."""
    from safetensors import safe_open

    meta = _read_metadata(path)
    _, _, tokens = _index_of(meta, path)
    size, free = os.path.getsize(path), free_bytes(torch.device("cpu"))
    if free is not None and size > free:
        raise BankError(f"{path}: {size / 2**30:.2f} GiB does not fit the host's {free / 2**30:.2f} GiB "
                        f"available memory")
    with safe_open(path, framework="pt", device="cpu") as f:
        layers = {n: f.get_tensor(n).clone() for n in f.keys()}
    info = _meta_json(meta, "layers", path, dict, "an object: layer -> {dtype, row, value_dtype, parts}")
    for name, v in info.items():
        if not isinstance(v, dict) or not isinstance(v.get("parts", []), list):
            raise BankError(f"{path}: metadata 'layers'[{name!r}] is {v!r}; expected an object with "
                            f"'dtype', 'row', 'value_dtype' and a 'parts' list")
    return dict(
        layers=layers,
        sequence_tokens=tokens,
        value_dtypes={n: str(v.get("value_dtype", "")) for n, v in info.items()},
        parts={n: v["parts"] for n, v in info.items() if v.get("parts")},
        metadata={k: v for k, v in meta.items() if k not in _RESERVED_META},
        source=path,
    )


def save(bank, path: str) -> None:
    """Write ``bank`` atomically (a temporary file in the same directory, then
    a rename: a failed write leaves any earlier file whole), with the mode the
    umask gives a new file."""
    from safetensors.torch import save_file

    meta = dict(bank.metadata)
    meta.update(
        format=BANK_FORMAT,
        version=BANK_VERSION,
        num_sequences=str(bank.num_sequences),
        num_positions=str(bank.num_positions),
        sequence_tokens=json.dumps([list(t) for t in bank.sequence_tokens]),
        layers=json.dumps({
            n: {"dtype": dtype_name(t.dtype), "row": t.shape[2],
                "value_dtype": bank.value_dtypes.get(n, ""), "parts": bank.parts.get(n, [])}
            for n, t in bank.layers.items()
        }),
    )
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        save_file({n: t.contiguous() for n, t in bank.layers.items()}, tmp, metadata=meta)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_metadata(path: str) -> dict[str, str]:
    """A bank file's ``__metadata__`` (no rows read); BankError for anything else."""
    if not os.path.exists(path):
        raise BankError(f"bank {path!r} does not exist; record one with `python -m kvfill.record`")
    if os.path.isdir(path):
        raise BankError(f"bank {path!r} is a directory; expected a bank file (`python -m kvfill.record --out`)")
    if not os.path.isfile(path):
        raise BankError(f"bank {path!r} is not a regular file; expected a bank file")
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = dict(f.metadata() or {})
    except Exception as exc:  # safetensors raises its own error types for a bad file
        raise BankError(f"{path}: cannot be read as a safetensors file: {exc}") from None
    if meta.get("format") != BANK_FORMAT:
        raise BankError(f"{path}: not a kvfill bank (metadata format {meta.get('format')!r}, "
                        f"expected {BANK_FORMAT!r})")
    if meta.get("version") != BANK_VERSION:
        raise BankError(f"{path}: bank version {meta.get('version')!r}; this kvfill reads version {BANK_VERSION!r}"
                        f" - record the bank again with `python -m kvfill.record`")
    return meta


def _meta_int(meta: Mapping[str, str], key: str, path: str) -> int:
    raw = meta.get(key)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or value < 1 or str(value) != str(raw).strip():
        raise BankError(f"{path}: metadata {key!r} is {raw!r}; expected an int >= 1")
    return value


def _meta_json(meta: Mapping[str, str], key: str, path: str, kind: type, expected: str):
    raw = meta.get(key)
    if raw is None:
        raise BankError(f"{path}: metadata {key!r} is missing; expected {expected}")
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise BankError(f"{path}: metadata {key!r} is not JSON ({exc}); expected {expected}") from None
    if not isinstance(value, kind):
        raise BankError(f"{path}: metadata {key!r} is a {type(value).__name__}; expected {expected}")
    return value


def _meta_tokens(meta: Mapping[str, str], path: str, num_sequences: int, num_positions: int) -> list:
    what = f"[] or {num_sequences} lists of {num_positions} token ids"
    tokens = _meta_json(meta, "sequence_tokens", path, list, what)
    if tokens and (len(tokens) != num_sequences
                   or any(not isinstance(t, list) or len(t) != num_positions for t in tokens)
                   or any(isinstance(x, bool) or not isinstance(x, int) for t in tokens for x in t)):
        raise BankError(f"{path}: metadata 'sequence_tokens' holds {len(tokens)} entries; expected {what}")
    return tokens


def _check_shapes(path: str, num_sequences: int, num_positions: int) -> None:
    """Every tensor of the file is ``[num_sequences, num_positions, row]`` (read from the header)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        names = list(f.keys())
        if not names:
            raise BankError(f"{path}: holds no layers")
        for name in names:
            shape = list(f.get_slice(name).get_shape())
            if len(shape) != 3 or shape[:2] != [num_sequences, num_positions]:
                raise BankError(f"{path}: layer {name!r} has shape {shape}, but the metadata says "
                                f"num_sequences={num_sequences}, num_positions={num_positions} "
                                f"(expected [{num_sequences}, {num_positions}, row])")


def free_bytes(device: torch.device) -> int | None:
    """Memory free for a bank on ``device``: the GPU's free memory, or the
    host's MemAvailable; None when unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
