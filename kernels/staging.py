"""Bank rows staged on the device per fill: a bank kept in host memory
(``FillEngine(bank_placement="host")``), and keys re-rotated to their true
positions past a recorded sequence's end (``past_bank="rotate"``,
``rotary.py``).

A bank recorded for long prompts is large - 128 KiB per token of an 8B model,
16 GiB per 128k-token sequence - and on the caches' device it takes memory
vLLM's KV cache would otherwise have.  Kept in host memory, the rows a fill's
replay entries read, and no others, are gathered on the host into a pinned
staging buffer, copied to a staging buffer on the device non-blocking -
one copy per replayed group and row size where a chunk fills the staging,
else one per layer, each into a contiguous slice (``host_copy.py``: a copy
into a strided slice goes through a device temporary) - stream-ordered
before the fill, and the fill reads them there; the row indices and
positions a step uploads go pinned and non-blocking too.  The bank stays where ``Bank.load`` put
it (pageable host memory): only the staging is pinned.  Re-rotating, the rows
of entries that reach past their sequence's end are staged the same way (from
the device-resident bank: a gather on the device into staging rows right
after the bank's own) and rotated there.

The kernels are unchanged.  Replay reads row ``first_s + l mod N_s`` of an
entry's sequence s at rank-local slot l; a staged entry names a *staged
sequence* instead, ``first = base + off - l0`` (``base``: where the staging
starts in the layer's rows, ``off``: where the entry's rows start in it,
``l0``: its first slot) of a length no slot reaches (``STAGED_LENGTH``), so
slot l reads staged row ``off + l - l0``; the fill's sequence table is the
bank's own (entries read in place) followed by the staged ones.  A fill with
more staged rows than the staging holds is written in chunks, each its own
gather, copy and launch; two pinned buffers alternate, and one is gathered
into again only after its last copy has completed (a CUDA event), so the host
gathers chunk k + 1 while chunk k is copied and written.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np
import torch

from kvfill.bank import DcpGeometry

from . import values as V
from . import host_copy
from .host_copy import copy_rows, pinned_empty, upload
from .plan import GroupFill
from .rotary import Rerotation

STAGED_LENGTH = 1 << 40  # a staged sequence's length: past every rank-local slot (< 2**31), so l mod it = l
STAGING_BYTES = 256 << 20  # the device staging's default size, over every staged layer


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
    """Host-kept layers of one group sharing a row size and bits dtype: one
    device staging ``[L, capacity, row]``, two pinned host buffers of as
    many elements, one copy per chunk."""

    group: str
    layers: tuple[str, ...]
    device: torch.Tensor
    pinned: tuple[torch.Tensor, torch.Tensor]


class Staging:
    """Staged rows per layer (module docstring).

    ``layers``: layer -> ``(its group, HostRows)`` (a host-kept bank), or
    ``(its group, rows)``: ``[T + capacity, row]`` on the device, the bank's
    T rows in the cache's order then the staging (re-rotation of a
    device-resident bank).  ``table``: the bank's int64 ``[S, 2]`` (first
    row, length) of this rank's part; ``dcp``: each group's geometry (true and
    recorded positions of a rank-local slot); ``rerotate``: layer ->
    ``Rerotation`` (applied to staged rows whose position is not the one
    they were recorded at); ``capacity``: staged rows per layer per chunk.
    """

    def __init__(self, layers: Mapping[str, tuple], table: np.ndarray, device: torch.device, capacity: int,
                 dcp: Mapping[str, DcpGeometry], rerotate: Mapping[str, Rerotation] | None = None,
                 asked_bytes: int | None = None):
        self.table = np.asarray(table, np.int64)
        self.device, self.capacity, self.dcp = device, int(capacity), dict(dcp)
        self.rerotate = dict(rerotate or {})
        self.asked_bytes = asked_bytes  # staging_bytes as given: less than one block's rows is raised to one block
        self.host = {n: r for n, (_, r) in layers.items() if isinstance(r, HostRows)}
        self.on_device = {n: r for n, (_, r) in layers.items() if not isinstance(r, HostRows)}
        self.base = int((self.table[:, 0] + self.table[:, 1]).max()) if self.on_device else 0  # the bank's rows
        self.group_of = {n: g for n, (g, _) in layers.items()}
        keyed: dict[tuple, list[str]] = {}
        for name, r in self.host.items():
            keyed.setdefault((self.group_of[name], r.rows.dtype, r.rows.shape[1]), []).append(name)
        self.parts: list[_Part] = []
        for (group, dtype, row), names in keyed.items():
            shape = (len(names), self.capacity, row)
            host = tuple(pinned_empty(shape[0] * shape[1] * row, dtype, device) for _ in range(2))
            self.parts.append(_Part(group, tuple(names), torch.empty(shape, dtype=dtype, device=device), host))
        self.groups = set(self.group_of.values())
        self._turn = 0
        self._done: list = [None, None]  # the last copy out of each pinned buffer (host_copy.record_event)

    @property
    def nbytes(self) -> int:
        """Device bytes the staging takes."""
        return self.capacity * sum(t.shape[-1] * t.element_size() for t in self.staging().values())

    def staging(self) -> dict[str, torch.Tensor]:
        """Layer -> its staging ``[capacity, row]`` on the device."""
        out = {name: p.device[i] for p in self.parts for i, name in enumerate(p.layers)}
        return {**out, **{n: r[self.base:] for n, r in self.on_device.items()}}

    def rows(self) -> dict[str, torch.Tensor]:
        """Layer -> the rows its fills read: the staging (a host-kept bank) or the bank's rows and staging."""
        return {**{n: s for n, s in self.staging().items() if n in self.host}, **self.on_device}

    def describe(self) -> str:
        every = sum(r.turns_all for r in self.rerotate.values())
        what = [f"re-rotating {len(self.rerotate)} layers' keys past each recorded sequence's end"
                + (f" (every key of {every}: the bank was rotated by another table)" if every else "")] \
            if self.rerotate else []
        if self.host:
            held = sum(r.rows.numel() * r.rows.element_size() for r in self.host.values())
            pinned = all(b.is_pinned() for p in self.parts for b in p.pinned)
            what.insert(0, f"bank in host memory: {len(self.host)} layers, {size(held)}")
            how = f"from {'pinned' if pinned else 'pageable'} host buffers"
        else:
            how = "gathered on the device"
        raised = (f"; staging_bytes {size(self.asked_bytes)} is less than one block's rows: raised to one block"
                  if self.asked_bytes is not None and self.nbytes > self.asked_bytes else "")
        return (f"{'; '.join(what)}; staged through {size(self.nbytes)} on {self.device} ({self.capacity} rows per "
                f"layer per chunk, {how}){raised}")

    # ------------------------------------------------------------ per fill
    def chunks(self, plan: Mapping[str, GroupFill]) -> Iterator[tuple[dict[str, GroupFill], np.ndarray]]:
        """The fill of ``plan`` (normalized, validated entries per group) as
        chunks whose staged rows are on the device when each is yielded:
        ``(the chunk's plan, its sequence table int64 [n, 2])``.  Entries
        read in place (all but a host-kept bank's: those whose every slot is
        below its sequence's end) and groups with nothing staged go whole
        with the first chunk; ValueError, before anything is staged, for a
        position past a rotary table."""
        staged, rest = {}, {}
        for g, e in plan.items():
            if g not in self.groups:
                rest[g] = e
                continue
            wrap = self._staged_entries(g, e)
            if (~wrap).any():
                rest[g] = e.select(~wrap)
            if wrap.any():
                staged[g] = e.select(wrap)
        self._check_positions(staged)
        own = self.table if self.on_device else np.zeros((0, 2), np.int64)
        bounds = {g: self._bounds(e) for g, e in staged.items()}
        for k in range(max((len(b) - 1 for b in bounds.values()), default=1)):
            turn = self._next_buffer()
            chunk, tables, n = dict(rest) if k == 0 else {}, [own], len(own)
            for g, e in staged.items():
                b = bounds[g]
                if k + 1 < len(b):
                    entries, table = self._stage(g, e, slice(b[k], b[k + 1]), n, turn)
                    chunk[g] = _merged(chunk.get(g), entries)
                    tables.append(table)
                    n += len(table)
            if self.parts:
                self._done[turn] = host_copy.record_event(self.device)
            yield chunk, padded(np.concatenate(tables))

    def _staged_entries(self, group: str, e: GroupFill) -> np.ndarray:
        """Which entries of ``group`` are staged: every one of a host-kept
        bank or of a layer recorded with another rotary table, else those
        reaching past their sequence's end (re-rotated)."""
        if self.host or self._turns_all(group):
            return np.ones(e.num_entries, dtype=bool)
        return e.local_base + e.slot_end > self.table[e.sequence, 1]

    def _turns_all(self, group: str) -> bool:
        """A layer of ``group`` was recorded with another rotary table: every key is turned."""
        return any(r.turns_all for n, r in self.rerotate.items() if self.group_of[n] == group)

    def _check_positions(self, staged: Mapping[str, GroupFill]) -> None:
        for g, e in staged.items():
            rot = [r for n, r in self.rerotate.items() if self.group_of[n] == g]
            if not rot or not e.num_entries:
                continue
            last = int(self.dcp[g].global_positions(np.asarray([int((e.local_base + e.slot_end).max()) - 1]))[0])
            have = min(r.positions for r in rot)
            if last >= have:
                raise ValueError(f"group {g!r}: position {last} is past the rotary table's {have} positions; "
                                 f"expected positions below the model's max_position_embeddings")

    def _next_buffer(self) -> int:
        """The pinned buffer the next chunk gathers into, once its last copy is done."""
        turn = self._turn
        self._turn ^= 1
        host_copy.wait_event(self._done[turn])  # the one host wait: a pinned buffer reused (docstring)
        self._done[turn] = None
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
        """Gather (and rotate) the rows of ``entries[which]`` of ``group``
        into its layers' staging (a host-kept bank's through pinned buffer
        ``turn``); the entries naming staged sequences ``first_id, first_id +
        1, ...`` and those sequences' (first row, length)."""
        start, end = entries.slot_start[which], entries.slot_end[which]
        base, seq = entries.local_base[which], entries.sequence[which]
        counts = end - start
        off = np.cumsum(counts) - counts  # each entry's first staged row
        n = int(counts.sum())
        local = np.repeat(base + start - off, counts) + np.arange(n)  # each staged row's rank-local slot
        s = np.repeat(seq, counts)
        held = local % self.table[s, 1]  # the slot's row within its sequence (= local below its end)
        rows = torch.from_numpy(self.table[s, 0] + held)
        self._copy(group, rows, turn)
        self._rotate(group, n, self.dcp[group].global_positions(local), self.dcp[group].global_positions(held))
        staged = np.stack([self.base + off - (base + start), np.full(counts.size, STAGED_LENGTH, np.int64)], axis=1)
        ids = first_id + np.arange(counts.size, dtype=np.int64)
        return GroupFill(entries.block_ids[which], start, end, base, ids), staged

    def _copy(self, group: str, rows: torch.Tensor, turn: int) -> None:
        """Rows ``rows`` of each layer of ``group`` into its staging
        ``[:len(rows)]``: a host-kept bank's gathered into pinned buffer
        ``turn``, then one non-blocking copy per part; a device-resident
        bank's gathered on the device."""
        n = rows.numel()
        for p in self.parts:
            if p.group != group:
                continue
            host = p.pinned[turn][: len(p.layers) * n * p.device.shape[2]].view(len(p.layers), n, -1)
            for i, name in enumerate(p.layers):
                self.host[name].gather(rows, out=host[i])
            copy_rows(p.device[:, :n], host)  # into contiguous slices: no device temporary
        index = None
        for name, r in self.on_device.items():
            if self.group_of[name] == group:
                index = upload(rows, self.device) if index is None else index
                torch.index_select(r[:self.base], 0, index, out=r[self.base:self.base + n])

    def _rotate(self, group: str, n: int, true: np.ndarray, held: np.ndarray) -> None:
        """The staged keys of ``group``'s rotary layers turned from the
        positions they were recorded at to the ones they are written at."""
        layers = [name for name in self.rerotate if self.group_of[name] == group]
        if not layers or ((true == held).all() and not self._turns_all(group)):
            return
        t, p = upload(torch.from_numpy(np.ascontiguousarray(np.stack([true, held]), np.int64)), self.device)
        staging, angles = self.staging(), {}
        for name in layers:  # the layers of one table share their angles
            r = self.rerotate[name]
            if r.key not in angles:
                angles[r.key] = r.angles(t, p)
            r.apply(staging[name][:n], t, p, angles[r.key])


def _merged(direct: GroupFill | None, staged: GroupFill) -> GroupFill:
    """A group's entries read in place followed by its staged ones."""
    if direct is None:
        return staged
    cols = [np.concatenate([a, b]) for a, b in zip(
        (direct.block_ids, direct.slot_start, direct.slot_end, direct.local_base, direct.sequence),
        (staged.block_ids, staged.slot_start, staged.slot_end, staged.local_base, staged.sequence))]
    return GroupFill(*cols)


def size(nbytes: int) -> str:
    """Bytes in the largest binary unit they reach."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def padded(table: np.ndarray) -> np.ndarray:
    """A fill's sequence table padded to a multiple of 16 rows (16 at least):
    Triton specialises an int argument on its divisibility by 16 and on being
    1, so the kernel sees one variant of the sequence count in every staged
    fill (and in warmup, which launches with ``padded`` of the bank's table)."""
    pad = np.zeros((-len(table) % 16 or (16 if not len(table) else 0), 2), np.int64)
    pad[:, 1] = STAGED_LENGTH
    return np.concatenate([table, pad])


def host_rows(rows: torch.Tensor, order: np.ndarray | None) -> HostRows:
    """A layer's stored rows (host) as ``HostRows`` of bits."""
    bits = rows.contiguous().view(V.BITS_DTYPE[rows.element_size()])
    return HostRows(bits, None if order is None else torch.from_numpy(np.asarray(order, np.int64)))
