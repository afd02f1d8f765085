"""Bulk write paths of the torch backend: whole pages a run of blocks per
call, and other large entries one copy each, written from their rows' value
starts.  Which launch classes write whole kernel-block pages is ``paged``'s.
Pages whose rows form contiguous regions (``(2, num_blocks, H, N, D)``
views) are gathered from the table straight into the cache, one
``index_select`` per region and run of consecutive blocks (``page_gather``,
``fill_pages_direct``); other whole pages (vLLM CPU's transposed K pages) go
through a small staging buffer and one strided copy per run
(``fill_pages_staged``), into the cache or into a ``PageImages`` store;
other large entries are one strided copy per kernel block they cross
(``fill_per_entry``).  Which entries take which path, and where their values
come from, is ``torch_fill``'s.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from . import values as V
from .layout import Layout
from .registry import LaunchClass

PAGE_BYTES = 64 << 10  # whole pages this large go a run of blocks per call (few calls per step)
# Rows gathered per step, by the staged page path here and by torch_fill's
# index-put path: stays in cache, no big temporaries.
CHUNK_BYTES = 4 << 20


def paged(c: LaunchClass) -> bool:
    """Whether whole pages of this class are written a run of blocks at a time
    (``torch_fill.ClassRows.pages``)."""
    layout = c.layout
    return (c.mode in (V.NORMAL, V.REPLAY) and bool(layout.elem_shape) and layout.kernel_split == 1
            and layout.slots_per_kernel_block * layout.row_size * layout.itemsize >= PAGE_BYTES)


def pages_staged(c: LaunchClass) -> bool:
    """Whether this class's whole pages go through ``fill_pages_staged`` (where ``PageImages`` pay)."""
    if not paged(c):
        return False
    gather = page_gather(c.layout)
    return gather is None or not gather.adjacent


class PageGather(NamedTuple):
    """How a layout's whole pages are gathered straight into the cache."""

    run: int                  # elements of the innermost (stride 1) element dim: one row
    elem_off: torch.Tensor    # [rows] value-index offset of each row of a region (slot part excluded)
    slot: torch.Tensor        # [rows] slot of each row of a region
    loop_mem: list[int]       # per region of a page: its element offset from the page
    loop_val: torch.Tensor    # [regions] per region: its value-index offset
    adjacent: bool            # a region of block b + 1 directly follows block b's: a run of blocks is one call


@functools.lru_cache(maxsize=64)
def page_gather(layout: Layout, device: torch.device | None = None) -> PageGather | None:
    """How to write whole kernel-block pages with ``index_select`` straight into
    the cache, when the page holds its innermost element dim (size ``run``,
    stride 1) in rows of one contiguous region that includes the slot dim -
    vLLM CPU's ``(2, num_blocks, H, N, D)``: each of K and V is one contiguous
    ``[H, N, D]`` region.  None for other layouts.  Its index tensors are on
    ``device`` (None: the CPU, whatever torch's default device is).  Cached: a
    function of the layout and device only, asked for every tensor of every fill.
    """
    if device is not None:
        host = page_gather(layout)
        if host is None:
            return None
        return host._replace(elem_off=host.elem_off.to(device), slot=host.slot.to(device),
                             loop_val=host.loop_val.to(device))
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
    grids = torch.meshgrid(*[torch.arange(sz, device="cpu") for sz, _, _ in region], indexing="ij")
    # Start from a grid-shaped zero: a region holding only the slot dim still has one row per slot.
    elem_off = sum((g * m for g, (_, _, m) in zip(grids, region) if m is not None), torch.zeros_like(grids[0]))
    slot = next(g for g, (_, _, m) in zip(grids, region) if m is None)
    loop_grids = (torch.meshgrid(*[torch.arange(sz, device="cpu") for sz, _, _ in loops], indexing="ij")
                  if loops else [])
    zero = torch.zeros((), dtype=torch.int64, device="cpu")
    loop_mem = sum((g * st for g, (_, st, _) in zip(loop_grids, loops)), zero)
    loop_val = sum((g * m for g, (_, _, m) in zip(loop_grids, loops)), zero)
    num_rows = elem_off.numel()
    return PageGather(run, elem_off.reshape(-1).long(), slot.reshape(-1), loop_mem.reshape(-1).tolist(),
                      loop_val.reshape(-1), layout.block_stride == num_rows * run)


def fill_pages_direct(cache, layout: Layout, ids: list[int], page_start, table) -> None:
    """Fill (normal, replay) of whole pages ``ids`` in one pass (no staging
    buffer), for layouts whose page regions of consecutive blocks are adjacent
    (``page_gather(layout).adjacent``); ``page_start[i, s]``: the value-source
    start of page i's slot s."""
    run, elem_off, slot, loop_mem, loop_val, _ = page_gather(layout, page_start.device)
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


def fill_pages_staged(view, layout: Layout, ids: list[int], page_start, table) -> None:
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


def fill_per_entry(view, layout: Layout, spans, table, start) -> None:
    """One copy (or fill) per entry, split at kernel blocks: ``spans`` holds
    ``(block, slot_start, slot_end, first)`` per entry, ``first`` the index
    in ``start`` (the entries' rows' value starts) of its first row."""
    kbs = layout.slots_per_kernel_block
    windows = table.unfold(0, layout.row_size, 1) if start is not None else None
    buf = None
    if windows is not None:
        buf = torch.empty(kbs, layout.row_size, dtype=table.dtype, device=view.device)
    for b, s, end, a in spans:
        while s < end:  # one piece per kernel block the slot range crosses
            j, lo = divmod(s, kbs)
            n = min(kbs - lo, end - s)
            dst = view[b, j, lo : lo + n]
            if windows is None:
                dst.fill_(table[0])
            else:
                vals = torch.index_select(windows, 0, start[a : a + n], out=buf[:n])
                dst.copy_(vals.view(n, *layout.elem_shape))
            a += n
            s += n
