"""A bank file on disk (the schema is in ``format.py``): its metadata read and
checked against the file's tensors before any row is read, the rows loaded
into memory this process owns, and the file written atomically.  Every
problem is a ``BankError`` naming the file, the key and what was expected.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import uuid
from typing import Mapping

import torch

from .format import BANK_FORMAT, BANK_VERSION, READ_VERSIONS, BankError, dtype_name
from .state import layouts_from_json, layouts_to_json, state_tensor_name

# A bank's identity, written once at save: a random id, and the digest of every
# other metadata key (so metadata edited afterwards is found).
_IDENTITY_META = ("bank_id", "metadata_sha256")
_RESERVED_META = ("format", "version", "num_sequences", "sequence_lengths", "sequence_tokens", "layers", "states",
                  *_IDENTITY_META)


def read_index(path: str) -> tuple[int, list[int], list, str]:
    """``(num_sequences, sequence_lengths, sequence_tokens, identity)`` of a
    bank file, from its metadata, checked against the file's tensors (header
    only)."""
    meta = _read_metadata(path)
    return (*_index_of(meta, path), identity_of(meta, path))


def metadata_digest(meta: Mapping[str, str]) -> str:
    """SHA-256 of a bank file's metadata but its identity keys."""
    body = {k: str(v) for k, v in meta.items() if k not in _IDENTITY_META}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def identity_of(meta: Mapping[str, str], path: str) -> str:
    """``<bank_id>/<metadata digest>`` of a bank file (``unsaved`` for a file
    written before banks had ids): two files of one identity hold one save
    of one recording.  A file whose metadata changed after its save is a
    BankError."""
    digest = metadata_digest(meta)
    stored = meta.get("metadata_sha256")
    if stored is not None and stored != digest:
        raise BankError(f"{path}: its metadata changed after the bank was saved (saved with metadata_sha256 "
                        f"{stored[:16]}..., it now hashes to {digest[:16]}...); banks are written whole by "
                        f"kvfill-record or Bank.save: record or save it again")
    return f"{meta.get('bank_id') or 'unsaved'}/{digest[:16]}"


def _index_of(meta: Mapping[str, str], path: str) -> tuple[int, list[int], list]:
    num_sequences = _meta_int(meta, "num_sequences", path)
    what = f"a list of {num_sequences} ints >= 1 (each sequence's positions)"
    lengths = _meta_json(meta, "sequence_lengths", path, list, what)
    if len(lengths) != num_sequences or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                            for n in lengths):
        raise BankError(f"{path}: metadata 'sequence_lengths' is {_short(lengths)}; expected {what}")
    _check_shapes(path, sum(lengths), num_sequences, layouts_from_json(meta.get("states"), path))
    return num_sequences, lengths, _meta_tokens(meta, path, lengths)


def load(path: str, part, fits=None) -> dict:
    """The keyword arguments of ``Bank(...)`` for a bank file's ``part``
    (``parts.BankPart``; only its columns and rows are read), in memory
    this process owns (not a mapping of the file: rewriting or truncating it
    later changes nothing here).  ``fits(row_bytes, state_bytes)``: why the bytes the part
    keeps - its rows and its TP cut of each state - do not fit where they go
    (None: they do), asked before any row is read; the host's available memory
    is checked against what reading it takes (each state tensor is read whole)."""
    from safetensors import safe_open

    meta = _read_metadata(path)
    _, lengths, tokens = _index_of(meta, path)
    info = layers_info(meta, path)
    kvs = {n: v.get("kv") or None for n, v in info.items()}
    layouts = {n: v for n, v in layouts_from_json(meta.get("states"), path).items() if part.wants(n)}
    state_names = {state_tensor_name(n, i) for n, lay in layouts_from_json(meta.get("states"), path).items()
                   for i in range(len(lay))}
    rows, local = part.rows(lengths)
    with safe_open(path, framework="pt", device="cpu") as f:
        slices = {n: f.get_slice(n) for n in f.keys() if part.wants(n) and n not in state_names}
        try:  # the part's columns (checked against each layer's kv before they are cut), and its states:
            rows_need = sum(sum(b - a for a, b in part.columns(n, kvs.get(n), sl.get_shape()[1])) * sum(local)
                            * _ITEMSIZE.get(sl.get_dtype(), 8) for n, sl in slices.items())
            # the host reads each state tensor whole before it cuts the rank's part; the rank keeps its cut
            states_read = sum(st.nbytes * len(lengths) for lay in layouts.values() for st in lay)
            states_kept = sum(st.local_nbytes(part.tp_rank, part.tp_size) * len(lengths)
                              for lay in layouts.values() for st in lay)
        except BankError as exc:
            raise BankError(f"{path}: {exc}") from None
        need = rows_need + states_read
        free = free_bytes(torch.device("cpu"))
        if free is not None and need > free:
            raise BankError(f"{path}: {part.describe()} takes {need / 2**30:.2f} GiB, more than the host's "
                            f"{free / 2**30:.2f} GiB available memory")
        problem = fits(rows_need, states_kept) if fits is not None else None
        if problem:
            raise BankError(f"{path}: {problem}")
        layers = {n: part.take(n, kvs.get(n), sl.get_shape()[1], lambda a, b, sl=sl: sl[:, a:b], rows)
                  for n, sl in slices.items()}
        try:  # each state tensor whole, then this rank's part of it
            states = {n: [st.take(f.get_tensor(state_tensor_name(n, i)), part.tp_rank, part.tp_size,
                                  f"state layer {n!r}").clone() for i, st in enumerate(lay)]
                      for n, lay in layouts.items()}
        except BankError as exc:
            raise BankError(f"{path}: {exc}") from None
    return dict(
        layers=layers,
        sequence_lengths=local,
        sequence_tokens=tokens,
        recorded_lengths=lengths,
        value_dtypes={n: str(v.get("value_dtype", "")) for n, v in info.items() if n in layers},
        kv={n: part.local_kv(n, kv) for n, kv in kvs.items() if kv and n in layers},
        parts={n: v["parts"] for n, v in info.items() if v.get("parts") and n in layers},
        states=states,
        state_layouts=layouts,
        metadata={k: v for k, v in meta.items() if k not in _RESERVED_META},
        source=path,
        part=part,
        identity=identity_of(meta, path),
    )


def layers_info(meta: Mapping[str, str], path: str) -> dict[str, dict]:
    """A bank file's metadata ``layers`` (layer -> ``{dtype, row,
    value_dtype, kv, parts}``), each entry checked; BankError naming the
    first that is not one."""
    info = _meta_json(meta, "layers", path, dict, "an object: layer -> {dtype, row, value_dtype, kv, parts}")
    for name, v in info.items():
        kv = v.get("kv") if isinstance(v, dict) else None
        parts = v.get("parts", []) if isinstance(v, dict) else None
        if not isinstance(v, dict) or not (isinstance(parts, list) and all(
                isinstance(p, list) and all(_is_int(x) and x >= 1 for x in p) for p in parts)) or not (
                kv is None or (isinstance(kv, list) and len(kv) == 3 and all(_is_int(x) and x >= 0 for x in kv))):
            raise BankError(f"{path}: metadata 'layers'[{name!r}] is {_short(v)}; expected an object with "
                            f"'dtype', 'row', 'value_dtype', 'kv' (null or [heads, head_size, head_size_v]) "
                            f"and 'parts' (a list of lists of dims >= 1)")
    return info


# Bytes per element of safetensors' dtype names (an unknown one counts 8: the check errs on the safe side).
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
             "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}


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
        sequence_lengths=json.dumps(list(bank.lengths)),
        sequence_tokens=json.dumps([list(t) for t in bank.sequence_tokens]),
        layers=json.dumps({
            n: {"dtype": dtype_name(t.dtype), "row": t.shape[1], "value_dtype": bank.value_dtypes.get(n, ""),
                "kv": list(bank.kv[n]) if n in bank.kv else None, "parts": bank.parts.get(n, [])}
            for n, t in bank.layers.items()
        }),
        states=layouts_to_json(bank.state_layouts),
    )
    meta["bank_id"] = uuid.uuid4().hex  # every save its own identity
    meta["metadata_sha256"] = metadata_digest(meta)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    os.close(fd)
    try:
        tensors = {n: t.contiguous() for n, t in bank.layers.items()}
        tensors.update({state_tensor_name(n, i): t.contiguous() for n, ts in bank.states.items()
                        for i, t in enumerate(ts)})
        save_file(tensors, tmp, metadata=meta)
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
    if meta.get("version") not in READ_VERSIONS:
        raise BankError(f"{path}: bank version {meta.get('version')!r}; this kvfill reads versions "
                        f"{list(READ_VERSIONS)} (ragged sequences, rows in the canonical K/V order) - record the bank "
                        f"again with `python -m kvfill.record` (the prompts file and model it was recorded from)")
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


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _meta_tokens(meta: Mapping[str, str], path: str, lengths: list[int]) -> list:
    what = (f"[] or {len(lengths)} lists of token ids (ints in [0, 2^63)), one per sequence, as long as "
            f"'sequence_lengths' says")
    tokens = _meta_json(meta, "sequence_tokens", path, list, what)
    if tokens and (len(tokens) != len(lengths)
                   or any(not isinstance(t, list) or len(t) != n for t, n in zip(tokens, lengths))
                   or any(not _is_int(x) or not 0 <= x < 2**63 for t in tokens for x in t)):
        raise BankError(f"{path}: metadata 'sequence_tokens' holds {len(tokens)} entries of lengths "
                        f"{[len(t) if isinstance(t, list) else None for t in tokens][:8]}; expected {what}")
    return tokens


def _check_shapes(path: str, num_rows: int, num_sequences: int, layouts: Mapping) -> None:
    """Every row tensor of the file is ``[num_rows, row]``, every state tensor
    ``[num_sequences, *its full shape]`` of its dtype, and each named in the
    metadata's ``states`` is there (read from the header)."""
    from safetensors import safe_open

    want = {state_tensor_name(n, i): st for n, lay in layouts.items() for i, st in enumerate(lay)}
    with safe_open(path, framework="pt", device="cpu") as f:
        names = list(f.keys())
        if not [n for n in names if n not in want]:
            raise BankError(f"{path}: holds no layers")
        missing = sorted(set(want) - set(names))
        if missing:
            raise BankError(f"{path}: metadata 'states' names state tensors {missing[:3]} the file does not hold")
        for name in names:
            sl = f.get_slice(name)
            shape = list(sl.get_shape())
            st = want.get(name)
            if st is not None:
                if shape != [num_sequences, *st.shape] or sl.get_dtype() != _SAFETENSORS_DTYPE.get(st.dtype):
                    raise BankError(f"{path}: state tensor {name!r} is {shape} of {sl.get_dtype()}; its metadata "
                                    f"names [{num_sequences}, {', '.join(map(str, st.shape))}] of "
                                    f"{dtype_name(st.dtype)} (one state per sequence)")
                continue
            if len(shape) != 2 or shape[0] != num_rows or shape[1] < 1:
                raise BankError(f"{path}: layer {name!r} has shape {shape}, but the metadata's sequence_lengths "
                                f"sum to {num_rows} rows (expected [{num_rows}, row])")


_SAFETENSORS_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


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
