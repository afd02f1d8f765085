"""A fill's planned rows: one row per planned slot, where each row's bits come
from (the value table at the row's hashed offset, or the bank's recorded row)
and what it must hold.  Shared by the torch backend (``torch_fill``), which
writes these rows, and ``verify``, which reads them back and compares; neither
backend's write paths are here.
"""
from __future__ import annotations

import numpy as np
import torch

from kvfill.bank import DcpGeometry

from . import values as V
from .layout import Layout, canonical_view
from .plan import GroupFill
from .registry import LaunchClass, LayerTensor


class SlotRows:
    """A group's normalized entries expanded to one row per planned slot (host arrays)."""

    def __init__(self, entries: GroupFill, dcp: DcpGeometry, sequences: np.ndarray | None = None):
        blocks, start, end = entries.block_ids, entries.slot_start, entries.slot_end
        counts = end - start
        n = int(counts.sum())
        entry = np.repeat(np.arange(blocks.size), counts)
        first = np.cumsum(counts) - counts
        slot = start[entry] + (np.arange(n, dtype=np.int64) - first[entry])
        self.num_rows = n
        self.entries = (blocks, start, end, first)  # per entry; its rows are [first, first + end - start)
        self.entry_base = entries.local_base          # per entry: the rank-local position of slot 0
        self.entry_sequence = entries.sequence
        self.block = blocks[entry]
        self.slot = slot
        self.local = entries.local_base[entry] + slot  # rank-local position (l = t without DCP)
        self.position = dcp.global_positions(self.local)
        self.dcp = dcp
        self.sequence = entries.sequence[entry]
        self.sequences = sequences  # replay: the (first row, length) the entries name, when not the bank's
        self._device_index: dict = {}

    def index(self, layout: Layout, device: torch.device):
        """Index tensors (block, kernel sub-block, slot-in-kernel-block)."""
        key = (layout.slots_per_kernel_block, torch.device(device))
        idx = self._device_index.get(key)
        if idx is None:
            kbs = layout.slots_per_kernel_block
            idx = tuple(
                torch.from_numpy(a).to(device)
                for a in (self.block, self.slot // kbs, self.slot % kbs)
            )
            self._device_index[key] = idx
        return idx


def value_source(c: LaunchClass, t: LayerTensor, rows: SlotRows,
                 sel: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where tensor ``t``'s planned rows come from: ``(source, start)``, row
    ``i`` being ``source[start[i] : start[i] + row_size]``, or every element
    ``source[0]`` when ``start`` is None (constant, zero).  ``sel``: the
    starts of these rows only (indices into ``rows``, in that order).

    normal: the class's value table at the rows' hashed offsets; replay: the
    layer's bank rows flattened, row ``start_s + l mod N_s`` of the row's
    sequence ``s`` at rank-local position l (``c.sequences``: the bank's first
    row and length of each sequence, this rank's part: ``kvfill/bank/parts.py``;
    ``rows.sequences``: a staged fill's instead, ``staging.py``), from the
    tensor's element offset within the layer's row - a staged bank's rows
    read from host memory when no staged sequences are named (verify).
    """
    position = rows.position if sel is None else rows.position[sel]
    if c.mode == V.REPLAY:
        table = c.sequences if rows.sequences is None else rows.sequences
        first, length = table[:, 0], table[:, 1]
        sequence = rows.sequence if sel is None else rows.sequence[sel]
        local = rows.local if sel is None else rows.local[sel]
        held = local % length[sequence]
        index = first[sequence] + held
        if rows.sequences is None and (t.host is not None or t.rerotate is not None):  # verify of a staged fill
            return _staged_rows(t, index, position, rows.dcp.global_positions(held))
        start = index * t.bank.shape[1] + t.elem_offset
        return t.bank.reshape(-1), torch.from_numpy(start).to(t.bank.device)
    if c.mode == V.NORMAL:
        offsets = V.row_offsets(t.key, position, t.elem_offset, V.pool_bits(c.part))
        return c.table, torch.from_numpy(offsets).to(c.table.device)
    return c.table, None


def _staged_rows(t: LayerTensor, index: np.ndarray, true: np.ndarray, held: np.ndarray):
    """What a staged fill wrote (``value_source``): rows ``index`` of the
    layer's bank where they are kept (host or device), in the cache's order,
    their keys turned from the positions ``held`` they were recorded at to
    ``true`` where the layer re-rotates."""
    idx = torch.from_numpy(index)
    source = t.host.gather(idx) if t.host is not None else t.bank[idx.to(t.bank.device)]
    if t.rerotate is not None:
        source = source.to(t.rerotate.table.device)
        t.rerotate.apply(source, *(torch.from_numpy(np.ascontiguousarray(x, np.int64)).to(source.device)
                                   for x in (true, held)))
    start = torch.from_numpy(np.arange(index.size) * source.shape[1] + t.elem_offset).to(source.device)
    return source.reshape(-1), start


def expected_rows(rows: SlotRows, layout: Layout, source: torch.Tensor, start: torch.Tensor | None) -> torch.Tensor:
    """Bits every planned slot must hold (``value_source``): ``[num_rows, row_size]`` or a scalar."""
    if start is None:
        return source[0]
    windows = source.unfold(0, layout.row_size, 1)  # window k = source[k : k + row]
    return windows[start]


def read_rows(cache: torch.Tensor, layout: Layout, rows: SlotRows) -> torch.Tensor:
    """The bits held by the planned slots: ``[num_rows, row_size]``."""
    view = canonical_view(cache, layout)
    return view[rows.index(layout, cache.device)].reshape(rows.num_rows, layout.row_size)
