"""Torch backend: the same fill as the Triton kernel, with torch ops.

Used for CPU caches (vLLM's CPU platform) and as the reference in tests.  It
expands the plan into one row per planned slot, builds the rows' bits from the
same value table (a row is a window of the table starting at the row's hashed
offset) and writes them with one ``index_put_`` per layer tensor through the
canonical strided view ``[num_blocks, r, kernel_block_size, *elem_shape]``.
The bytes are identical to the Triton path's by construction.
"""
from __future__ import annotations

import numpy as np
import torch

from . import values as V
from .layout import Layout, canonical_view


class SlotRows:
    """A group's plan expanded to one row per planned slot (host arrays)."""

    def __init__(self, blocks, start, end, base, dcp: tuple[int, int, int]):
        counts = end - start
        n = int(counts.sum())
        entry = np.repeat(np.arange(blocks.size), counts)
        first = np.cumsum(counts) - counts
        slot = start[entry] + (np.arange(n, dtype=np.int64) - first[entry])
        world, rank, interleave = dcp
        self.num_rows = n
        self.block = blocks[entry]
        self.slot = slot
        self.position = V.dcp_positions(base[entry] + slot, world, rank, interleave)
        self._device_index: dict = {}

    def index(self, layout: Layout, device: torch.device):
        """Index tensors (block, kernel sub-block, slot-in-kernel-block)."""
        key = (layout.kernel_block_size, torch.device(device))
        idx = self._device_index.get(key)
        if idx is None:
            kbs = layout.kernel_block_size
            idx = tuple(
                torch.from_numpy(a).to(device)
                for a in (self.block, self.slot // kbs, self.slot % kbs)
            )
            self._device_index[key] = idx
        return idx


def expected_rows(
    rows: SlotRows, layout: Layout, mode: str, table: torch.Tensor, key: int, elem_offset: int
) -> torch.Tensor:
    """Bits every planned slot must hold: ``[num_rows, row_size]`` or a scalar.

    ``table``: ``values.value_table`` with ``max_row >= layout.row_size``.
    """
    if mode != V.NORMAL:
        return table[0]
    start = V.row_offsets(key, rows.position, elem_offset)
    windows = table.unfold(0, layout.row_size, 1)  # window k = table[k : k + row]
    return windows[torch.from_numpy(start).to(table.device)]


CHUNK_BYTES = 4 << 20  # rows gathered per step: stays in cache, no big temporaries


def fill_rows(
    cache: torch.Tensor,
    layout: Layout,
    rows: SlotRows,
    mode: str,
    table: torch.Tensor,
    key: int,
    elem_offset: int,
) -> None:
    """Write every planned row of one tensor.

    Normal mode gathers the rows' table windows chunk by chunk into one reused
    buffer and index-puts each chunk: a temporary as large as the fill would
    cost more in page faults than the copy itself.
    """
    view = canonical_view(cache, layout)
    idx = rows.index(layout, cache.device)
    if mode != V.NORMAL:
        view.index_put_(idx, table[0])
        return
    windows = table.unfold(0, layout.row_size, 1)
    start = torch.from_numpy(V.row_offsets(key, rows.position, elem_offset)).to(cache.device)
    chunk = max(1, CHUNK_BYTES // (layout.row_size * layout.itemsize))
    buf = torch.empty(min(chunk, rows.num_rows), layout.row_size, dtype=table.dtype, device=cache.device)
    for a in range(0, rows.num_rows, chunk):
        b = min(a + chunk, rows.num_rows)
        vals = torch.index_select(windows, 0, start[a:b], out=buf[: b - a])
        view.index_put_(tuple(i[a:b] for i in idx), vals.view(b - a, *layout.elem_shape))


def read_rows(cache: torch.Tensor, layout: Layout, rows: SlotRows) -> torch.Tensor:
    """The bits held by the planned slots: ``[num_rows, row_size]``."""
    view = canonical_view(cache, layout)
    return view[rows.index(layout, cache.device)].reshape(rows.num_rows, layout.row_size)
