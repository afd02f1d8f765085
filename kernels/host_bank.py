"""A bank kept in host memory, its rows staged per fill
(``FillEngine(bank_placement="host")``).

A bank recorded for long prompts is large - 128 KiB per token of an 8B model,
16 GiB per 128k-token sequence - and on the caches' device it takes memory
vLLM's KV cache would otherwise have.  Kept in host memory, the rows a fill's
replay entries read, and no others, are gathered on the host into a pinned
staging buffer, copied to a staging buffer on the device with one
non-blocking copy per replayed group and row size, stream-ordered before the
fill, and the fill reads them there.  The bank stays where ``Bank.load`` put
it (pageable host memory): only the staging is pinned.

The kernels are unchanged.  Replay reads row ``first_s + l mod N_s`` of an
entry's sequence s at rank-local slot l; a staged fill names a *staged
sequence* per entry instead, ``first = off - l0`` (``off``: where the entry's
rows start in the staging, ``l0``: its first slot) of a length no slot
reaches (``STAGED_LENGTH``), so slot l reads staged row ``off + l - l0``.  A
fill with more rows than the staging holds is written in chunks, each its own
gather, copy and launch; two pinned buffers alternate, and one is gathered
into again only after its last copy has completed (a CUDA event), so the host
gathers chunk k + 1 while chunk k is copied and written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np
import torch

from . import values as V
from .plan import GroupFill

STAGED_LENGTH = 1 << 40  # a staged sequence's length: past every rank-local slot (< 2**31), so l mod it = l
STAGING_BYTES = 256 << 20  # the device staging's default size, over every replayed layer


@dataclass(frozen=True)
class HostRows:
    """One layer's bank rows in host memory: ``rows`` ``[T, row]`` as bits in
    the bank's order, ``order`` the columns that put a row in its cache's
    element order (None: the same order)."""

    rows: torch.Tensor
    order: torch.Tensor | None = None

    def gather(self, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``index`` (host int64) in the cache's order, into ``out`` if given."""
        if self.order is None:
            return torch.index_select(self.rows, 0, index, out=out)
        return torch.index_select(torch.index_select(self.rows, 0, index), 1, self.order, out=out)


@dataclass(frozen=True)
class _Part:
    """Replayed layers of one group sharing a row size and bits dtype: one
    device staging ``[L, capacity, row]``, two pinned host buffers of as
    many elements, one copy per chunk."""

    group: str
    layers: tuple[str, ...]
    device: torch.Tensor
    pinned: tuple[torch.Tensor, torch.Tensor]


class StagedBank:
    """Host rows per replayed layer and their device staging (module docstring).

    ``layers``: layer -> ``(its group, HostRows)``; ``table``: the bank's
    int64 ``[S, 2]`` (first row, length) of this rank's part;
    ``staging_bytes``: the device staging's size over every layer (it holds
    at least one block of each replayed group: ``min_rows``).
    """

    def __init__(self, layers: Mapping[str, tuple[str, HostRows]], table: np.ndarray, device: torch.device,
                 staging_bytes: int, min_rows: int):
        self.host = {name: rows for name, (_, rows) in layers.items()}
        self.table = np.asarray(table, np.int64)
        self.device = device
        row_bytes = sum(r.rows.shape[1] * r.rows.element_size() for r in self.host.values())
        self.capacity = max(int(min_rows), int(staging_bytes) // max(row_bytes, 1))
        self.bytes_per_row = row_bytes
        pin = device.type == "cuda"
        keyed: dict[tuple, list[str]] = {}
        for name, (group, r) in layers.items():
            keyed.setdefault((group, r.rows.dtype, r.rows.shape[1]), []).append(name)
        self.parts: list[_Part] = []
        for (group, dtype, row), names in keyed.items():
            shape = (len(names), self.capacity, row)
            host = tuple(torch.empty(shape[0] * shape[1] * row, dtype=dtype, device="cpu", pin_memory=pin)
                         for _ in range(2))
            self.parts.append(_Part(group, tuple(names), torch.empty(shape, dtype=dtype, device=device), host))
        self.groups = {p.group for p in self.parts}
        self._turn = 0
        self._done: list[torch.cuda.Event | None] = [None, None]  # the last copy out of each pinned buffer

    @property
    def nbytes(self) -> int:
        """Device bytes the staging takes."""
        return self.capacity * self.bytes_per_row

    def staging(self) -> dict[str, torch.Tensor]:
        """Layer -> its device staging ``[capacity, row]`` (what the fill reads)."""
        return {name: p.device[i] for p in self.parts for i, name in enumerate(p.layers)}

    def describe(self) -> str:
        held = sum(r.rows.numel() * r.rows.element_size() for r in self.host.values())
        pinned = all(b.is_pinned() for p in self.parts for b in p.pinned)
        return (f"bank in host memory: {len(self.host)} layers, {size(held)}; staged through {size(self.nbytes)} "
                f"on {self.device} ({self.capacity} rows per layer per copy, from "
                f"{'pinned' if pinned else 'pageable'} host buffers)")

    # ------------------------------------------------------------ per fill
    def chunks(self, plan: Mapping[str, GroupFill]) -> Iterator[tuple[dict[str, GroupFill], np.ndarray]]:
        """The fill of ``plan`` (normalized, validated entries per group) as
        chunks whose replayed rows are staged on the device when each is
        yielded: ``(the chunk's plan, its staged sequences int64 [n, 2])``,
        the plan's replayed entries naming staged sequences.  Groups that
        replay nothing go whole with the first chunk."""
        replayed = {g: e for g, e in plan.items() if g in self.groups}
        rest = {g: e for g, e in plan.items() if g not in self.groups}
        bounds = {g: self._bounds(e) for g, e in replayed.items()}
        for k in range(max((len(b) - 1 for b in bounds.values()), default=1)):
            turn = self._next_buffer()
            chunk, tables, n = dict(rest) if k == 0 else {}, [], 0
            for g, e in replayed.items():
                b = bounds[g]
                if k + 1 < len(b):
                    entries, table = self._stage(g, e, slice(b[k], b[k + 1]), n, turn)
                    chunk[g] = entries
                    tables.append(table)
                    n += len(table)
            if self.device.type == "cuda":
                self._done[turn] = torch.cuda.Event()
                self._done[turn].record()
            yield chunk, padded(np.concatenate(tables) if tables else np.zeros((0, 2), np.int64))

    def _next_buffer(self) -> int:
        """The pinned buffer the next chunk gathers into, once its last copy is done."""
        turn = self._turn
        self._turn ^= 1
        if self._done[turn] is not None:
            self._done[turn].synchronize()
        return turn

    def _bounds(self, entries: GroupFill) -> list[int]:
        """Entry indices where a group's chunks start (and its end): each
        chunk's slots fit the staging's capacity."""
        counts = entries.slot_end - entries.slot_start
        bounds, total = [0], 0
        for i, c in enumerate(counts.tolist()):
            if total + c > self.capacity:
                bounds.append(i)
                total = 0
            total += c
        return bounds + [len(counts)]

    def _stage(self, group: str, entries: GroupFill, which: slice, first_id: int,
               turn: int) -> tuple[GroupFill, np.ndarray]:
        """Gather and copy the rows of ``entries[which]`` of ``group``
        (through pinned buffer ``turn``);
        the entries naming staged sequences ``first_id, first_id + 1, ...``
        and those sequences' (first row, length)."""
        start, end = entries.slot_start[which], entries.slot_end[which]
        base, seq = entries.local_base[which], entries.sequence[which]
        counts = end - start
        off = np.cumsum(counts) - counts  # each entry's first staged row
        n = int(counts.sum())
        local = np.repeat(base + start - off, counts) + np.arange(n)  # each staged row's rank-local slot
        s = np.repeat(seq, counts)
        rows = torch.from_numpy(self.table[s, 0] + local % self.table[s, 1])
        self._copy(group, rows, turn)
        staged = np.stack([off - (base + start), np.full(counts.size, STAGED_LENGTH, np.int64)], axis=1)
        ids = first_id + np.arange(counts.size, dtype=np.int64)
        return GroupFill(entries.block_ids[which], start, end, base, ids), staged

    def _copy(self, group: str, rows: torch.Tensor, turn: int) -> None:
        """Rows ``rows`` of each layer of ``group`` into its device staging
        ``[:len(rows)]``: gathered into pinned buffer ``turn``, then one
        non-blocking copy per part."""
        n = rows.numel()
        for p in self.parts:
            if p.group != group:
                continue
            host = p.pinned[turn][: len(p.layers) * n * p.device.shape[2]].view(len(p.layers), n, -1)
            for i, name in enumerate(p.layers):
                self.host[name].gather(rows, out=host[i])
            p.device[:, :n].copy_(host, non_blocking=True)


def size(nbytes: int) -> str:
    """Bytes in the largest binary unit they reach."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def padded(table: np.ndarray) -> np.ndarray:
    """Staged sequences padded to a multiple of 16 rows (16 at least): Triton
    specialises an int argument on its divisibility by 16 and on being 1, so
    the kernel sees one variant of the sequence count in every staged fill
    (and in warmup, which launches with ``padded`` of none)."""
    pad = np.zeros((-len(table) % 16 or (16 if not len(table) else 0), 2), np.int64)
    pad[:, 1] = STAGED_LENGTH
    return np.concatenate([table, pad])


def host_rows(rows: torch.Tensor, order: np.ndarray | None) -> HostRows:
    """A layer's stored rows (host) as ``HostRows`` of bits."""
    bits = rows.contiguous().view(V.BITS_DTYPE[rows.element_size()])
    return HostRows(bits, None if order is None else torch.from_numpy(np.asarray(order, np.int64)))
