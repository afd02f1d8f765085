"""A bank's canonical row order, and the permutation to each cache's own.

An attention layer's bank row for one token is the layer's K, then its V:
``K[num_kv_heads, head_size]`` then ``V[num_kv_heads, head_size_v]``, row-major
(``head_size_v`` 0: MLA's latent row ``[kv_lora_rank + rope dim]`` as "K" of
one head).  This is the order of no particular cache: every cache view of the
layer holds the same elements in an order its backend chose, recognised here
from the logical element dims of its tensors (``Registry.row_parts``, dims of
size 1 left out) and the layer's geometry:

    [[H, D], [H, Dv]]   K and V as two tensors (vLLM CPU)           canonical
    [[2, H, D]]         K/V outermost (FlashAttention, FlashInfer)  canonical
    [[D]]               MLA (H = 1, Dv = 0)                         canonical
    [[H, D + Dv]]       per head, K then V ([B, H, N, 2 x head])    permuted

``RowFormat.order`` maps the canonical row to the cache's (``cache[:, i] =
canonical[:, order[i]]``), applied once when a bank is staged for an engine
and, inverted, when a recorder reads a cache into a bank.  A layer whose view
matches none (e.g. recurrent state) keeps its own order, named by its parts;
such rows replay only into the same view.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

KvGeometry = tuple  # (num_kv_heads, head_size, head_size_v)


def _drop_ones(parts) -> list[list[int]]:
    return [[int(d) for d in p if int(d) > 1] for p in parts]


def _views(h: int, d: int, dv: int) -> list[tuple[list[list[int]], np.ndarray]]:
    """Every recognised view of a layer of geometry ``(h, d, dv)``: its
    parts (ones dropped) and the canonical index of each of its elements."""
    k = np.arange(h * d, dtype=np.int64).reshape(h, d)
    v = h * d + np.arange(h * dv, dtype=np.int64).reshape(h, dv)
    ident = np.arange(h * (d + dv), dtype=np.int64)
    out = [(_drop_ones([[h, d], [h, dv]] if dv else [[h, d]]), ident)]
    if dv == d and d:
        out.append((_drop_ones([[2, h, d]]), ident))
    if dv:
        out.append((_drop_ones([[h, d + dv]]), np.concatenate([k, v], axis=1).reshape(-1)))
    return out


def infer_geometry(parts: Sequence[Sequence[int]]) -> KvGeometry | None:
    """The geometry a view names without help: two tensors ``[H, D]`` and
    ``[H, Dv]``, one ``[2, H, D]``, or one flat ``[D]`` (MLA); None otherwise
    (``[H, D + Dv]`` cannot be told from one head of size ``D + Dv``)."""
    p = [list(map(int, x)) for x in parts]
    if len(p) == 2 and len(p[0]) == 2 and len(p[1]) == 2 and p[0][0] == p[1][0]:
        return (p[0][0], p[0][1], p[1][1])
    if len(p) == 2 and len(p[0]) == 1 and len(p[1]) == 1:
        return (1, p[0][0], p[1][0])
    if len(p) == 1 and len(p[0]) == 3 and p[0][0] == 2:
        return (p[0][1], p[0][2], p[0][2])
    if len(p) == 1 and len(p[0]) == 1:
        return (1, p[0][0], 0)
    return None


@dataclass(frozen=True)
class RowFormat:
    """How one layer's cache row relates to the bank's: ``kv`` the geometry
    (None: the cache's own order, named by ``parts``), ``order`` the canonical
    index of each cache element (None: the same order)."""

    parts: tuple[tuple[int, ...], ...]
    kv: KvGeometry | None = None
    order: np.ndarray | None = None

    @classmethod
    def of(cls, parts: Sequence[Sequence[int]], kv: KvGeometry | None = None, where: str = "layer") -> "RowFormat":
        """The format of a cache view; ``kv`` given (the model's) or inferred.
        A view that is no known one of the geometry keeps its own order."""
        frozen = tuple(tuple(int(d) for d in p) for p in parts)
        geometry = tuple(int(x) for x in kv) if kv is not None else infer_geometry(_drop_ones(parts))
        if geometry is None:
            return cls(frozen)
        h, d, dv = geometry
        if min(h, d) < 1 or dv < 0:
            raise ValueError(f"{where}: KV geometry {geometry} is invalid; expected (num_kv_heads >= 1, "
                             f"head_size >= 1, head_size_v >= 0)")
        have = _drop_ones(parts)
        orders = [order for view, order in _views(h, d, dv) if view == have]
        if not orders:  # e.g. a packed fp8 row with its scales: its own order
            return cls(frozen)
        if any(not np.array_equal(o, orders[0]) for o in orders[1:]):
            raise ValueError(f"{where}: cache element dims {[list(p) for p in frozen]} fit more than one order "
                             f"of {geometry}; cannot place K and V")
        order = orders[0]
        return cls(frozen, geometry, None if np.array_equal(order, np.arange(order.size)) else order)

    @property
    def canonical(self) -> bool:
        return self.kv is not None

    def to_cache(self, rows):
        """Bank rows ``[..., row]`` in this cache's element order."""
        return rows if self.order is None else rows[..., self._index(rows, self.order)]

    def to_bank(self, rows):
        """Cache rows ``[..., row]`` in the bank's (canonical) order."""
        return rows if self.order is None else rows[..., self._index(rows, np.argsort(self.order))]

    @staticmethod
    def _index(rows, order: np.ndarray):
        if isinstance(rows, np.ndarray):
            return order
        import torch

        return torch.from_numpy(order).to(rows.device)
