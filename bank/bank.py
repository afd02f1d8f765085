"""``Bank``: a bank in memory - recorded rows per layer (the schema: ``format.py``),
checked as it is built, a rank's part selected (``parts.py``), read from and
written to a bank file (``files.py``); checked against a cache in ``checks.py``.
"""
from __future__ import annotations

import os
from typing import Mapping, Sequence

import numpy as np
import torch

from . import files
from .checks import check_rows, state_pages
from .format import BankError, dtype_name
from .index import BankIndex
from .parts import WHOLE, BankPart
from .rows import RowFormat
from .state import StateTensor


def _geometry(source: str, name: str, kv) -> tuple[int, int, int]:
    g = tuple(kv) if isinstance(kv, (list, tuple)) else ()
    if len(g) != 3 or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in g) \
            or min(g[0], g[1]) < 1 or g[2] < 0:
        raise BankError(f"{source}: layer {name!r} kv is {kv!r}; expected [num_kv_heads >= 1, head_size >= 1, "
                        f"head_size_v >= 0]")
    return tuple(int(x) for x in g)


def _packed(source: str, layers, sequence_lengths, sequence_tokens) -> tuple[dict, list[int]]:
    """Every layer as ``[T, R]`` and the sequences' lengths, after checking
    the layers agree on them."""
    out, shapes = {}, {}
    for name, t in layers.items():
        if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3) or min(t.shape) < 1:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise BankError(f"{source}: layer {name!r} is {got}; expected a tensor [rows, row] or "
                            f"[sequences, positions, row] with every dim >= 1")
        shapes[name] = tuple(t.shape[:-1])
        out[name] = t.reshape(-1, t.shape[-1]) if t.dim() == 3 else t
    if len(set(shapes.values())) != 1:
        raise BankError(f"{source}: layers disagree on their rows: {shapes}")
    shape = next(iter(shapes.values()))
    if len(shape) == 2:
        lengths = [shape[1]] * shape[0]
        if sequence_lengths is not None and list(sequence_lengths) != lengths:
            raise BankError(f"{source}: sequence_lengths {list(sequence_lengths)[:8]} disagree with "
                            f"layers of [{shape[0]}, {shape[1]}, row]")
    else:
        if sequence_lengths is None:
            sequence_lengths = [len(t) for t in sequence_tokens] or [shape[0]]
        lengths = [int(n) for n in sequence_lengths]
        if not lengths or min(lengths) < 1 or sum(lengths) != shape[0]:
            raise BankError(f"{source}: sequence_lengths {lengths[:8]} (sum {sum(lengths)}) must be ints "
                            f">= 1 summing to the layers' {shape[0]} rows")
    return out, lengths


class Bank:
    """Recorded rows per layer (the schema: ``format.py``).

    ``layers``: layer name -> ``[T, R]`` rows of ``sequence_lengths``
    sequences one after another, or ``[S, N, R]`` (S sequences of N
    positions each); host memory as given.  ``sequence_tokens``: each
    sequence's prompt token ids (optional: without them every block replays a
    sequence chosen by a hash of its prefix); ``value_dtypes``: layer -> the
    float dtype its bytes encode (``dtype_name``); ``kv``: layer -> ``(heads,
    head_size, head_size_v)`` of a canonical row; ``parts``: layer -> the
    element dims of the cache tensors it was read from; ``metadata``:
    provenance strings; ``part``: what of the recorded bank this is
    (``parts.py``; then ``kv`` is the part's geometry, ``sequence_lengths``
    its local lengths and ``recorded_lengths`` the sequences' own).
    """

    def __init__(
        self,
        layers: Mapping[str, torch.Tensor],
        *,
        sequence_lengths: Sequence[int] | None = None,
        sequence_tokens: Sequence[Sequence[int]] = (),
        value_dtypes: Mapping[str, str] | None = None,
        kv: Mapping[str, Sequence[int] | None] | None = None,
        parts: Mapping[str, Sequence[Sequence[int]]] | None = None,
        metadata: Mapping[str, str] | None = None,
        source: str = "bank",
        recorded_lengths: Sequence[int] | None = None,
        part: BankPart = WHOLE,
        identity: str | None = None,
        states: Mapping[str, Sequence[torch.Tensor]] | None = None,
        state_layouts: Mapping[str, Sequence[StateTensor]] | None = None,
    ):
        if not layers:
            raise BankError(f"{source}: holds no layers")
        self.source = source
        self.identity = identity  # the file's (files.identity_of); None: built in memory
        self.layers, lengths = _packed(source, layers, sequence_lengths, sequence_tokens)
        self.lengths = tuple(int(n) for n in lengths)
        self.starts = tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.lengths)[:-1]]))
        self.part = part
        self.recorded_lengths = tuple(int(n) for n in recorded_lengths) if recorded_lengths else self.lengths
        self.sequence_tokens = tuple(tuple(int(x) for x in t) for t in sequence_tokens)
        if self.sequence_tokens and [len(t) for t in self.sequence_tokens] != list(self.recorded_lengths):
            raise BankError(f"{source}: sequence_tokens must be {self.num_sequences} lists of the sequences' "
                            f"lengths {list(self.recorded_lengths)[:8]}, got lengths "
                            f"{[len(t) for t in self.sequence_tokens][:8]}")
        self.value_dtypes = dict(value_dtypes or {})
        self.kv = {n: _geometry(source, n, g) for n, g in (kv or {}).items() if g}
        self.parts = {n: [list(p) for p in v] for n, v in (parts or {}).items()}
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.state_layouts = {n: tuple(v) for n, v in (state_layouts or {}).items()}
        self.states = {n: list(v) for n, v in (states or {}).items()}
        self._check_states()
        for name, (h, d, dv) in self.kv.items():
            if name in self.layers and self.layers[name].shape[1] != h * (d + dv):
                raise BankError(f"{source}: layer {name!r} rows have {self.layers[name].shape[1]} elements, its kv "
                                f"{[h, d, dv]} names {h * (d + dv)}")

    def _check_states(self) -> None:
        """Every state layer has its layout, and each of its tensors is
        ``[num_sequences, *this part's shape]`` of the layout's dtype."""
        if set(self.states) != set(self.state_layouts):
            raise BankError(f"{self.source}: state layers {sorted(self.states)[:4]} and state layouts "
                            f"{sorted(self.state_layouts)[:4]} disagree")
        for name, tensors in self.states.items():
            layout = self.state_layouts[name]
            want = [(self.num_sequences, *st.local_shape(self.part.tp_rank, self.part.tp_size)) for st in layout]
            got = [tuple(t.shape) for t in tensors]
            if got != want or [t.dtype for t in tensors] != [st.dtype for st in layout]:
                raise BankError(f"{self.source}: state layer {name!r} holds {got} of "
                                f"{[dtype_name(t.dtype) for t in tensors]}; expected {want} of "
                                f"{[dtype_name(st.dtype) for st in layout]} (one state per sequence)")

    # ------------------------------------------------------------ questions
    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def num_positions(self) -> int:
        """The longest sequence's length."""
        return max(self.lengths)

    @property
    def num_rows(self) -> int:
        return sum(self.lengths)

    @property
    def nbytes(self) -> int:
        return self.row_bytes + self.state_bytes

    @property
    def row_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers.values())

    @property
    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.states.values() for t in ts)

    @property
    def bytes_per_token(self) -> int:
        """Bank bytes per recorded token position: layers x row bytes."""
        return sum(t.shape[1] * t.element_size() for t in self.layers.values())

    @property
    def index(self) -> BankIndex:
        return BankIndex(self.num_sequences, self.recorded_lengths, self.sequence_tokens)

    def sequence_table(self) -> np.ndarray:
        """int64 ``[S, 2]``: each sequence's first row and length."""
        return np.stack([np.asarray(self.starts, np.int64), np.asarray(self.lengths, np.int64)], axis=1)

    def describe(self) -> str:
        lo, hi = min(self.lengths), max(self.lengths)
        span = f"{lo}" if lo == hi else f"{lo}-{hi}"
        part = "" if self.part.whole else f" ({self.part.describe()}: this rank's part)"
        held = "positions held here" if self.part.dcp.sharded else "positions"
        states = (f", {len(self.states)} state layers ({self.state_bytes / 2**20:.1f} MiB, one state per sequence)"
                  if self.states else "")
        return (f"{self.source}{part}: {len(self.layers)} layers x {self.num_sequences} sequences of {span} "
                f"{held} ({self.num_rows} rows), {self.bytes_per_token} B per token{states}, "
                f"{self.nbytes / 2**20:.1f} MiB")

    def select(self, part: BankPart) -> "Bank":
        """This bank's ``part`` (``parts.py``) in memory of its own, as ``load(path, part)`` reads it."""
        if not self.part.whole:
            raise BankError(f"{self.source}: is already a part ({self.part.describe()}); select from a whole bank")
        rows, local = part.rows(self.lengths)
        layers = {n: part.take(n, self.kv.get(n), t.shape[1], lambda a, b, t=t: t[:, a:b], rows)
                  for n, t in self.layers.items() if part.wants(n)}
        return Bank(layers, sequence_lengths=local, sequence_tokens=self.sequence_tokens,
                    value_dtypes={n: v for n, v in self.value_dtypes.items() if n in layers},
                    kv={n: part.local_kv(n, g) for n, g in self.kv.items() if n in layers},
                    parts={n: v for n, v in self.parts.items() if n in layers}, metadata=self.metadata,
                    source=self.source, recorded_lengths=self.lengths, part=part, identity=self.identity,
                    states={n: [st.take(t, part.tp_rank, part.tp_size, f"state layer {n!r}").clone()
                                for st, t in zip(self.state_layouts[n], ts)]
                            for n, ts in self.states.items() if part.wants(n)},
                    state_layouts={n: v for n, v in self.state_layouts.items() if part.wants(n)})

    def rows_for(self, name: str, dtype: torch.dtype, fmt: RowFormat,
                 value_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The layer's rows in the element order of a cache of ``dtype`` whose
        row is described by ``fmt`` and whose bytes encode ``value_dtype``,
        after checking they fit; BankError naming what differs."""
        rows, order = check_rows(self, name, dtype, fmt, value_dtype)
        return rows if order is None else order.to_cache(rows)

    def check_rows(self, name: str, dtype: torch.dtype, fmt: RowFormat,
                   value_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, RowFormat | None]:
        """``rows_for`` without the permutation (``checks.check_rows``)."""
        return check_rows(self, name, dtype, fmt, value_dtype)

    def state_pages(self, name: str, shapes, dtypes, alignment: int = 1) -> torch.Tensor:
        """A state layer's recorded states as pages ``[S, page bytes]`` (uint8)
        for a cache whose spec names ``shapes``, ``dtypes`` and ``alignment``
        (vLLM's ``state_alignment``; ``checks.state_pages``)."""
        return state_pages(self, name, shapes, dtypes, alignment)


    # ------------------------------------------------------------ files
    def save(self, path: str | os.PathLike) -> None:
        """Write the bank file atomically (``files.save``); a whole bank only."""
        if not self.part.whole:
            raise BankError(f"{self.source}: a rank's part ({self.part.describe()}) is not a bank file's whole "
                            f"bank; save the bank it was selected from")
        files.save(self, os.fspath(path))

    @classmethod
    def load(cls, path: str | os.PathLike, part: BankPart = WHOLE, fits=None) -> "Bank":
        """Read a bank file, or one rank's ``part`` of it (only that part is
        read), into memory this process owns; BankError when it is not a
        well-formed bank of this format, its metadata disagrees with its
        tensors, or the part is larger than the host's available memory or
        ``fits(row_bytes, state_bytes)`` says why it does not fit (asked before reading rows).
        The rows land in host memory whatever torch's default device is
        (safetensors' slices are made by factories that follow it)."""
        with torch.device("cpu"):
            return cls(**files.load(os.fspath(path), part, fits))
