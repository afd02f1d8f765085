"""What one rank of a parallel engine holds of a bank.

A bank is canonical and whole (``format.py``): every layer, every KV head,
every recorded position.  A rank writes only part of it, and loads only that:

* tensor parallelism (TP size T, rank r): a layer of H KV heads puts heads
  ``[r * H/T, (r + 1) * H/T)`` on rank r; with fewer heads than ranks
  (H < T) each head is replicated on T/H consecutive ranks, rank r holding
  head ``r // (T/H)`` (vLLM's ``QKVParallelLinear``).  A layer of one head -
  MLA's latent row, or one shared KV head - is whole on every rank.  The
  rank's row is its heads' K, then their V: columns ``[lo*D, hi*D)`` and
  ``[H*D + lo*Dv, H*D + hi*Dv)`` of the canonical row.
* pipeline parallelism: the stage's layers only (``layers``).
* the serving length (``max_positions``, vLLM's ``max_model_len``): rows of
  positions no request can reach are not loaded.  A sequence recorded longer
  is cut to ``max_positions``; positions below it replay the same rows
  (``t mod N`` = t = ``t mod max_positions`` for every t < max_positions).
* decode context parallelism (``DcpGeometry`` W, r, I): rank r holds the
  tokens t with ``(t // I) % W == r`` at rank-local index l, so of a
  sequence of N positions it loads the rows of its own positions
  ``t(0), t(1), ... < N`` in local order - ``local_count(N)`` rows, 1/W of
  them - and replays local slot l from local row ``l mod L``.  Below N every
  rank writes exactly the rows a W = 1 engine writes; past N (a prompt longer
  than its recording wraps) each rank wraps within its own rows, which equals
  W = 1's ``t mod N`` when N is a multiple of I*W.  A rank holding none of a
  sequence (N <= r*I) keeps the I rows W = 1 would give its first I slots.

A layer stored in its cache's own order (no K/V geometry) cannot be split by
heads: loading it under TP > 1 is a BankError, unless the rank's cache holds
it whole (``whole_layers``: one KV head, e.g. MLA's fp8-packed latent).  One
bank serves one DCP geometry: groups sharded differently (a draft model's
unsharded layers beside sharded ones) are refused by the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from .dcp import NO_DCP, DcpGeometry
from .format import BankError


def head_range(num_heads: int, tp_rank: int, tp_size: int, where: str = "layer") -> tuple[int, int]:
    """KV heads ``[lo, hi)`` of a layer of ``num_heads`` on TP rank ``tp_rank``."""
    h, r, t = int(num_heads), int(tp_rank), int(tp_size)
    if h == 1 or t == 1:
        return 0, h
    if t <= h:
        if h % t:
            raise BankError(f"{where}: {h} KV heads cannot be split over tensor parallel size {t}; expected a "
                            f"size dividing {h}")
        per = h // t
        return r * per, (r + 1) * per
    if t % h:
        raise BankError(f"{where}: {h} KV heads cannot be replicated over tensor parallel size {t}; expected a "
                        f"multiple of {h}")
    head = r // (t // h)
    return head, head + 1


@dataclass(frozen=True)
class BankPart:
    """One rank's part of a bank (module docstring).  The default: all of it."""

    tp_rank: int = 0
    tp_size: int = 1
    layers: frozenset[str] | None = None  # None: every layer the bank holds
    dcp: DcpGeometry = NO_DCP
    # Layers of no K/V geometry (their cache's own order) that a rank's cache holds whole: one KV head
    # (MLA's packed latent).  Canonical rows are cut by their heads whatever this says.
    whole_layers: frozenset[str] = frozenset()
    max_positions: int | None = None  # None: every recorded position; else positions [0, max_positions)

    def __post_init__(self):
        r, t = self.tp_rank, self.tp_size
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (r, t)) or t < 1 or not 0 <= r < t:
            raise ValueError(f"tensor parallel rank {r!r} of size {t!r} is invalid; expected ints with "
                             f"size >= 1 and 0 <= rank < size")
        m = self.max_positions
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"max_positions {m!r} is invalid; expected None or an int >= 1 (the serving "
                             f"max_model_len)")
        if self.layers is not None:
            object.__setattr__(self, "layers", frozenset(self.layers))
        object.__setattr__(self, "whole_layers", frozenset(self.whole_layers))

    @property
    def whole(self) -> bool:
        return (self.tp_size == 1 and self.layers is None and not self.dcp.sharded
                and self.max_positions is None)

    def wants(self, name: str) -> bool:
        return self.layers is None or name in self.layers

    def columns(self, name: str, kv: Sequence[int] | None, row: int) -> list[tuple[int, int]]:
        """The column ranges of a layer's canonical rows this rank holds, and its local geometry."""
        if self.tp_size == 1 or (kv is None and name in self.whole_layers):  # K/V rows: cut by their heads
            return [(0, row)]
        if kv is None:
            raise BankError(f"layer {name!r} holds rows in its cache's own element order (no K/V geometry): they "
                            f"cannot be split over tensor parallel size {self.tp_size}; record the bank on a "
                            f"platform whose cache view kvfill knows (kvfill/bank/rows.py)")
        h, d, dv = (int(x) for x in kv)
        if row != h * (d + dv):  # cut by a geometry that does not name them, a part holds other heads' bytes
            raise BankError(f"layer {name!r} rows have {row} elements, its kv {[h, d, dv]} names {h * (d + dv)}")
        lo, hi = head_range(h, self.tp_rank, self.tp_size, f"layer {name!r}")
        out = [(lo * d, hi * d)]
        if dv:
            out.append((h * d + lo * dv, h * d + hi * dv))
        return out

    def local_kv(self, name: str, kv: Sequence[int]) -> tuple[int, int, int]:
        h, d, dv = (int(x) for x in kv)
        lo, hi = head_range(h, self.tp_rank, self.tp_size, f"layer {name!r}")
        return hi - lo, d, dv

    def rows(self, lengths: Sequence[int]) -> tuple[np.ndarray | None, list[int]]:
        """The whole bank's rows this rank holds, in local order (None: all),
        and each sequence's local length."""
        lengths = [int(n) for n in lengths]
        cut = [n if self.max_positions is None else min(n, self.max_positions) for n in lengths]
        if not self.dcp.sharded and cut == lengths:
            return None, lengths
        index, local = [], []
        first = 0
        for n, kept in zip(lengths, cut):
            if self.dcp.sharded:
                count = int(self.dcp.local_count(kept)) or self.dcp.interleave
                index.append(first + self.dcp.global_positions(np.arange(count)) % n)
            else:
                count = kept
                index.append(first + np.arange(count))
            local.append(count)
            first += n
        return np.concatenate(index), local

    def take(self, name: str, kv, row: int, read: Callable[[int, int], torch.Tensor],
             rows: np.ndarray | None) -> torch.Tensor:
        """A layer's part in memory of its own: ``read(c0, c1)`` gives the
        whole bank's columns ``[c0, c1)`` of every row; one layer's column
        slice lives at a time."""
        cols = self.columns(name, kv, row)
        t = torch.cat([read(a, b) for a, b in cols], dim=1) if len(cols) > 1 else read(*cols[0])
        if rows is not None:
            t = t[torch.from_numpy(rows)]
        return t.contiguous() if len(cols) > 1 or rows is not None else t.clone()

    def describe(self) -> str:
        bits = []
        if self.tp_size > 1:
            bits.append(f"TP rank {self.tp_rank}/{self.tp_size}")
        if self.layers is not None:
            bits.append(f"{len(self.layers)} layers")
        if self.dcp.sharded:
            bits.append(f"DCP rank {self.dcp.rank}/{self.dcp.world_size} (interleave {self.dcp.interleave})")
        if self.max_positions is not None:
            bits.append(f"positions < {self.max_positions}")
        return ", ".join(bits) or "whole"


WHOLE = BankPart()
