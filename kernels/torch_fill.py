"""Torch backend: the same fill as the Triton kernel, with torch ops.

Used for CPU caches (vLLM's CPU platform) and as the reference in tests.  It
expands the plan into one row per planned slot, builds the rows' bits from the
same value table (a row is a window of the table starting at the row's hashed
offset) and writes them through the canonical strided view ``[num_blocks, r,
slots_per_kernel_block, *elem_shape]``.  Large entries: whole pages whose rows
form contiguous regions (vLLM CPU's ``(2, num_blocks, H, N, D)``) are gathered
from the table straight into the cache, one ``index_select`` per region and
run of consecutive blocks (one pass, no staging buffer); other large entries
one strided ``copy_`` each; many small ones chunked ``index_put_``.  The bytes
are identical to the Triton path's by construction.
"""
from __future__ import annotations

import functools
import math
from typing import Mapping, NamedTuple

import numpy as np
import torch

from . import values as V
from .backend import FillBackend
from .dcp import DcpGeometry
from .layout import Layout, canonical_view
from .plan import GroupFill
from .registry import LaunchClass, LayerTensor


class SlotRows:
    """A group's normalized entries expanded to one row per planned slot (host arrays)."""

    def __init__(self, entries: GroupFill, dcp: DcpGeometry):
        blocks, start, end = entries.block_ids, entries.slot_start, entries.slot_end
        counts = end - start
        n = int(counts.sum())
        entry = np.repeat(np.arange(blocks.size), counts)
        first = np.cumsum(counts) - counts
        slot = start[entry] + (np.arange(n, dtype=np.int64) - first[entry])
        self.num_rows = n
        self.entries = (blocks, start, end, first)  # per entry; its rows are [first, first + end - start)
        self.block = blocks[entry]
        self.slot = slot
        self.position = dcp.global_positions(entries.local_base[entry] + slot)
        self.sequence = entries.sequence[entry]
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


def value_source(c: LaunchClass, t: LayerTensor, rows: SlotRows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where tensor ``t``'s planned rows come from: ``(source, start)``, row
    ``i`` being ``source[start[i] : start[i] + row_size]``, or every element
    ``source[0]`` when ``start`` is None (constant, zero).

    normal: the class's value table at the rows' hashed offsets; replay: the
    layer's bank rows flattened, row ``(sequence, position mod N)``, from the
    tensor's element offset within the layer's row.
    """
    if c.mode == V.REPLAY:
        seqs, positions, layer_row = t.bank.shape
        row = rows.sequence * positions + rows.position % positions
        start = row * layer_row + t.elem_offset
        return t.bank.reshape(-1), torch.from_numpy(start).to(t.bank.device)
    if c.mode == V.NORMAL:
        return c.table, torch.from_numpy(V.row_offsets(t.key, rows.position, t.elem_offset)).to(c.table.device)
    return c.table, None


def expected_rows(rows: SlotRows, layout: Layout, source: torch.Tensor, start: torch.Tensor | None) -> torch.Tensor:
    """Bits every planned slot must hold (``value_source``): ``[num_rows, row_size]`` or a scalar."""
    if start is None:
        return source[0]
    windows = source.unfold(0, layout.row_size, 1)  # window k = source[k : k + row]
    return windows[start]


CHUNK_BYTES = 4 << 20  # rows gathered per step: stays in cache, no big temporaries


def fill_rows(
    cache: torch.Tensor,
    layout: Layout,
    rows: SlotRows,
    table: torch.Tensor,
    start: torch.Tensor | None,
) -> None:
    """Write every planned row of one tensor from ``value_source``'s ``(table, start)``.

    Whole pages of >= PAGE_BYTES (a request's every block but its last) with
    a start (normal, replay) are written a run of blocks at a time
    (``_fill_pages_direct`` / ``_fill_pages_staged``).  The other entries:
    large ones one strided copy each, small ones gathered chunk by chunk into
    one reused buffer and index-put (a temporary as large as the fill would
    cost more in page faults than the copy itself).
    """
    view = canonical_view(cache, layout)
    blocks, s0, s1, first = rows.entries
    kbs = layout.slots_per_kernel_block
    rest = None  # entries left to the per-entry / index_put paths; None: all
    page_bytes = kbs * layout.row_size * layout.itemsize
    if start is not None and layout.elem_shape and layout.kernel_split == 1 and page_bytes >= PAGE_BYTES:
        whole = (s0 == 0) & (s1 == kbs)
        if whole.any():
            w = np.flatnonzero(whole)
            ids = blocks[w].tolist()
            page_start = start[torch.from_numpy(first[w][:, None] + np.arange(kbs)).to(start.device)]
            gather = _page_gather(layout)
            if gather is not None and gather.adjacent:
                _fill_pages_direct(cache, layout, ids, page_start, table, gather)
            else:
                _fill_pages_staged(view, layout, ids, page_start, table)
            if whole.all():
                return
            rest = ~whole
    counts = s1 - s0 if rest is None else (s1 - s0)[rest]
    entry_bytes = counts.sum() * layout.row_size * layout.itemsize / max(1, counts.size)
    if entry_bytes >= PER_ENTRY_BYTES:
        _fill_per_entry(view, layout, rows, table, start, np.ones(blocks.size, bool) if rest is None else rest)
        return
    idx = rows.index(layout, cache.device)
    if rest is not None:  # the rows of the remaining entries
        keep = torch.from_numpy(np.repeat(rest, s1 - s0)).to(cache.device)
        idx = tuple(i[keep] for i in idx)
        start = start[keep]
    n = idx[0].numel()
    if start is None:
        view.index_put_(idx, table[0])
        return
    windows = table.unfold(0, layout.row_size, 1)
    chunk = max(1, CHUNK_BYTES // (layout.row_size * layout.itemsize))
    buf = torch.empty(min(chunk, n), layout.row_size, dtype=table.dtype, device=cache.device)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        vals = torch.index_select(windows, 0, start[a:b], out=buf[: b - a])
        view.index_put_(tuple(i[a:b] for i in idx), vals.view(b - a, *layout.elem_shape))


PAGE_BYTES = 64 << 10  # whole pages this large go a run of blocks per call (few calls per step)
# Entries this large (bytes) are written one strided copy each: per-call overhead
# (~10 us) is small next to the copy, and a copy beats index_put ~2x on whole
# pages of >= 256 KiB (measured: 512 KiB pages 2.2x faster, 64 KiB pages 1.5x slower).
PER_ENTRY_BYTES = 256 << 10


class PageGather(NamedTuple):
    """How a layout's whole pages are gathered straight into the cache."""

    run: int                  # elements of the innermost (stride 1) element dim: one row
    elem_off: torch.Tensor    # [rows] value-index offset of each row of a region (slot part excluded)
    slot: torch.Tensor        # [rows] slot of each row of a region
    loop_mem: list[int]       # per region of a page: its element offset from the page
    loop_val: torch.Tensor    # [regions] per region: its value-index offset
    adjacent: bool            # a region of block b + 1 directly follows block b's: a run of blocks is one call


@functools.lru_cache(maxsize=64)
def _page_gather(layout: Layout) -> PageGather | None:
    """How to write whole kernel-block pages with ``index_select`` straight into
    the cache, when the page holds its innermost element dim (size ``run``,
    stride 1) in rows of one contiguous region that includes the slot dim -
    vLLM CPU's ``(2, num_blocks, H, N, D)``: each of K and V is one contiguous
    ``[H, N, D]`` region.  None for other layouts.  Cached: a function of the
    layout only, asked for every tensor of every fill.
    """
    if not layout.elem_shape or layout.elem_strides[-1] != 1 or layout.kernel_split != 1:
        return None
    run = layout.elem_shape[-1]
    mult = [1] * len(layout.elem_shape)  # value-index multiplier of each element dim (row-major)
    for i in range(len(mult) - 2, -1, -1):
        mult[i] = mult[i + 1] * layout.elem_shape[i + 1]
    dims = [(layout.slots_per_kernel_block, layout.slot_stride, None)]
    dims += [(sz, st, m) for sz, st, m in zip(layout.elem_shape[:-1], layout.elem_strides[:-1], mult[:-1])]
    dims.sort(key=lambda d: -d[1])
    region, expected = [], run
    for d in reversed(dims):  # innermost first: contiguous while strides continue the run
        if d[1] != expected:
            break
        region.insert(0, d)
        expected *= d[0]
    if not any(m is None for _, _, m in region):
        return None
    loops = [d for d in dims if d not in region]
    # Rows of the region in memory order: their slot and element value offset.
    grids = torch.meshgrid(*[torch.arange(sz) for sz, _, _ in region], indexing="ij")
    # Start from a grid-shaped zero: a region holding only the slot dim still has one row per slot.
    elem_off = sum((g * m for g, (_, _, m) in zip(grids, region) if m is not None), torch.zeros_like(grids[0]))
    slot = next(g for g, (_, _, m) in zip(grids, region) if m is None)
    loop_grids = torch.meshgrid(*[torch.arange(sz) for sz, _, _ in loops], indexing="ij") if loops else []
    loop_mem = sum((g * st for g, (_, st, _) in zip(loop_grids, loops)), torch.zeros((), dtype=torch.int64))
    loop_val = sum((g * m for g, (_, _, m) in zip(loop_grids, loops)), torch.zeros((), dtype=torch.int64))
    num_rows = elem_off.numel()
    return PageGather(run, elem_off.reshape(-1).long(), slot.reshape(-1), loop_mem.reshape(-1).tolist(),
                      loop_val.reshape(-1), layout.block_stride == num_rows * run)


def _fill_pages_direct(cache, layout: Layout, ids: list[int], page_start, table, gather: PageGather) -> None:
    """Fill (normal, replay) of whole pages ``ids`` in one pass (no staging
    buffer), for layouts whose page regions of consecutive blocks are adjacent
    (``gather.adjacent``); ``page_start[i, s]``: the value-source start of
    page i's slot s."""
    run, elem_off, slot, loop_mem, loop_val, _ = gather
    windows = table.unfold(0, run, 1)  # window k = table[k : k + run]
    # Value index of every row of every region of every page: [regions, pages, rows].
    idx = (page_start[:, slot][None, :, :] + elem_off[None, None, :] + loop_val[:, None, None]).contiguous()
    bits = cache.view(V.BITS_DTYPE[layout.itemsize]) if cache.dim() else cache
    base = cache.storage_offset()
    num_rows = elem_off.numel()
    # A region of block b + 1 directly follows block b's (K and V
    # [num_blocks, H, N, D] each): a run of consecutive block ids is one
    # contiguous region, one index_select for the whole run.
    p = 0
    while p < len(ids):
        q = p + 1
        while q < len(ids) and ids[q] == ids[q - 1] + 1:
            q += 1
        page = base + ids[p] * layout.block_stride
        for r, off in enumerate(loop_mem):
            out = bits.as_strided(((q - p) * num_rows, run), (run, 1), page + off)
            torch.index_select(windows, 0, idx[r, p:q].reshape(-1), out=out)
        p = q


def _fill_pages_staged(view, layout: Layout, ids: list[int], page_start, table) -> None:
    """Fill of whole pages through a small staging buffer, for layouts whose
    pages are not one row-contiguous region (vLLM CPU: K pages transposed, V
    pages between them), where a direct gather takes a call per head.

    Up to CHUNK_BYTES of consecutive pages at a time: one ``index_select``
    gathers them as ``[pages, *outer element dims, slots, last element dim]``
    (windows of the last dim), then one strided copy writes them - with the
    slot dim next to the last element dim, a transposed destination reads
    the staging at a short stride.  ``page_start[i, s]``: the value-source
    start of page i's slot s.
    """
    kbs = layout.slots_per_kernel_block
    *outer, last = layout.elem_shape
    num_outer = math.prod(outer)
    windows = table.unfold(0, last, 1)
    outer_off = torch.arange(num_outer, device=page_start.device).view(1, num_outer, 1) * last
    # the canonical view [pages, kbs, *outer, last] seen as [pages, *outer, kbs, last]
    perm = (0, *range(2, 2 + len(outer)), 1, 1 + len(layout.elem_shape))
    per_chunk = max(1, CHUNK_BYTES // (kbs * layout.row_size * layout.itemsize))
    buf = torch.empty(min(per_chunk, len(ids)) * layout.row_size * kbs // last, last, dtype=table.dtype,
                      device=view.device)
    p = 0
    while p < len(ids):
        q = p + 1
        while q < len(ids) and q - p < per_chunk and ids[q] == ids[q - 1] + 1:
            q += 1
        idx = (page_start[p:q].view(q - p, 1, kbs) + outer_off).reshape(-1)
        vals = torch.index_select(windows, 0, idx, out=buf[: idx.numel()])
        dst = view[ids[p]: ids[q - 1] + 1, 0].permute(perm)
        dst.copy_(vals.view(dst.shape))
        p = q


def _fill_per_entry(view, layout: Layout, rows: SlotRows, table, start, only: np.ndarray) -> None:
    """One copy (or fill) per entry where ``only`` is true, split at kernel blocks."""
    kbs = layout.slots_per_kernel_block
    windows = table.unfold(0, layout.row_size, 1) if start is not None else None
    buf = None
    if windows is not None:
        buf = torch.empty(kbs, layout.row_size, dtype=table.dtype, device=view.device)
    for b, s0, s1, a in zip(*(x[only].tolist() for x in rows.entries)):
        s = s0
        while s < s1:  # one piece per kernel block the slot range crosses
            j, lo = divmod(s, kbs)
            n = min(kbs - lo, s1 - s)
            dst = view[b, j, lo : lo + n]
            if windows is None:
                dst.fill_(table[0])
            else:
                vals = torch.index_select(windows, 0, start[a : a + n], out=buf[:n])
                dst.copy_(vals.view(n, *layout.elem_shape))
            a += n
            s += n


def read_rows(cache: torch.Tensor, layout: Layout, rows: SlotRows) -> torch.Tensor:
    """The bits held by the planned slots: ``[num_rows, row_size]``."""
    view = canonical_view(cache, layout)
    return view[rows.index(layout, cache.device)].reshape(rows.num_rows, layout.row_size)


class TorchBackend(FillBackend):
    """Fills with torch ops: CPU caches (vLLM's CPU platform), and the tests' reference."""

    name = "torch"

    def fill(self, plan: Mapping[str, GroupFill]) -> int:
        rows = {g: SlotRows(entries, self.registry.groups[g].dcp) for g, entries in plan.items()}
        for c in self.registry.classes:
            r = rows.get(c.group)
            if r is None:
                continue
            for t in c.tensors:
                fill_rows(t.tensor, c.layout, r, *value_source(c, t, r))
        return 0
