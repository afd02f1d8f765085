"""Torch backend: the same fill as the Triton kernel, with torch ops.

Used for CPU caches (vLLM's CPU platform) and as the reference in tests.  It
expands the plan into one row per planned slot, builds the rows' bits from the
same value table (a row is a window of the table starting at the row's hashed
offset) and writes them through the canonical strided view ``[num_blocks, r,
slots_per_kernel_block, *elem_shape]``.  How each entry is written is worked
out once per launch class and fill (``ClassRows``).  Whole pages whose rows
form contiguous regions (``(2, num_blocks, H, N, D)`` views) are gathered from
the table straight into the cache, one ``index_select`` per region and run of
consecutive blocks; other whole pages (vLLM CPU's transposed K pages) are
copied from ``PageImages`` - the same pages written once, by the staging path,
into a store - and so are partial blocks whose page the store holds; other
large entries one strided ``copy_`` each; many small ones chunked
``index_put_``.  The bytes are identical to the Triton path's by construction.
"""
from __future__ import annotations

import contextlib
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
        self.entry_base = entries.local_base          # per entry: the rank-local position of slot 0
        self.entry_sequence = entries.sequence
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


def value_source(c: LaunchClass, t: LayerTensor, rows: SlotRows,
                 sel: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where tensor ``t``'s planned rows come from: ``(source, start)``, row
    ``i`` being ``source[start[i] : start[i] + row_size]``, or every element
    ``source[0]`` when ``start`` is None (constant, zero).  ``sel``: the
    starts of these rows only (indices into ``rows``, in that order).

    normal: the class's value table at the rows' hashed offsets; replay: the
    layer's bank rows flattened, row ``(sequence, position mod N)``, from the
    tensor's element offset within the layer's row.
    """
    position = rows.position if sel is None else rows.position[sel]
    if c.mode == V.REPLAY:
        seqs, positions, layer_row = t.bank.shape
        sequence = rows.sequence if sel is None else rows.sequence[sel]
        start = (sequence * positions + position % positions) * layer_row + t.elem_offset
        return t.bank.reshape(-1), torch.from_numpy(start).to(t.bank.device)
    if c.mode == V.NORMAL:
        return c.table, torch.from_numpy(V.row_offsets(t.key, position, t.elem_offset)).to(c.table.device)
    return c.table, None


def expected_rows(rows: SlotRows, layout: Layout, source: torch.Tensor, start: torch.Tensor | None) -> torch.Tensor:
    """Bits every planned slot must hold (``value_source``): ``[num_rows, row_size]`` or a scalar."""
    if start is None:
        return source[0]
    windows = source.unfold(0, layout.row_size, 1)  # window k = source[k : k + row]
    return windows[start]


CHUNK_BYTES = 4 << 20  # rows gathered per step: stays in cache, no big temporaries


class ClassRows:
    """One launch class's planned rows, split by the path that writes them:
    the same for every tensor of the class, so worked out once per fill.

    ``pages``: the entries that are whole pages of >= PAGE_BYTES with a value
    start (normal, replay; a request's every block but its last), written a
    run of blocks at a time - gathered straight into the cache where a
    layout's page regions are adjacent (``gather``), else through the staging
    buffer or, with ``PageImages``, copied from its store (``slots``: each
    page's page there, -1: none; ``new``: written there first by this fill).
    ``partial``: the other entries whose page the store holds, copied from it
    (``partial_slots``).  ``rest``: the other entries, large ones one strided copy each
    (``per_entry``), small ones gathered chunk by chunk into one reused
    buffer and index-put (a temporary as large as the fill would cost more in
    page faults than the copy itself).
    """

    def __init__(self, rows: SlotRows, c: LaunchClass, images: PageImages | None = None):
        layout = self.layout = c.layout
        self.rows = rows
        blocks, s0, s1, first = rows.entries
        kbs = layout.slots_per_kernel_block
        row_bytes = layout.row_size * layout.itemsize
        whole = ((s0 == 0) & (s1 == kbs)) if _paged(c) else np.zeros(blocks.size, dtype=bool)
        self.pages = np.flatnonzero(whole)
        self.page_ids = blocks[self.pages].tolist()
        gather = _page_gather(layout) if self.pages.size else None
        self.gather = gather if gather is not None and gather.adjacent else None
        self.slots = self.new = None
        self.partial = self.partial_slots = np.zeros(0, dtype=np.int64)
        rest = ~whole
        if images is not None:  # a class with images: its pages are staged (_pages_staged), not gathered
            slots, new = images.assign(rows)
            self.slots, self.new = slots[self.pages], new[self.pages]
            from_store = rest & (slots >= 0)
            self.partial = np.flatnonzero(from_store)
            self.partial_slots = slots[self.partial]
            rest &= ~from_store
        self.rest = np.flatnonzero(rest)
        counts = s1[self.rest] - s0[self.rest]
        self.rest_first = np.cumsum(counts) - counts  # each rest entry's first row in rest_rows
        self.rest_rows = np.repeat(first[self.rest] - self.rest_first, counts) + np.arange(counts.sum())
        self.per_entry = bool(counts.size) and counts.sum() * row_bytes / counts.size >= PER_ENTRY_BYTES
        self._rest_index = None

    def page_rows(self, which) -> np.ndarray:
        """The rows of the pages ``pages[which]``, page by page, slot by slot."""
        first = self.rows.entries[3][self.pages[which]]
        return (first[:, None] + np.arange(self.layout.slots_per_kernel_block)).reshape(-1)

    def rest_index(self, device) -> tuple[torch.Tensor, ...]:
        """Index tensors (block, kernel sub-block, slot) of the rest rows."""
        if self._rest_index is None:
            idx = self.rows.index(self.layout, device)
            if self.rest_rows.size != self.rows.num_rows:
                sel = torch.from_numpy(self.rest_rows).to(device)
                idx = tuple(i[sel] for i in idx)
            self._rest_index = idx
        return self._rest_index


def fill_tensor(c: LaunchClass, t: LayerTensor, rows: ClassRows, store: torch.Tensor | None = None) -> None:
    """Write every planned row of tensor ``t`` of class ``c`` (``ClassRows``
    says which path writes which entry; ``store``: the tensor's
    ``PageImages`` store, when the class keeps page images)."""
    layout = c.layout
    view = canonical_view(t.tensor, layout)
    kbs = layout.slots_per_kernel_block
    if rows.pages.size:
        if rows.slots is not None:
            _fill_pages_via_store(c, t, rows, view, store)
        elif rows.gather is not None:
            table, start = value_source(c, t, rows.rows, rows.page_rows(slice(None)))
            _fill_pages_direct(t.tensor, layout, rows.page_ids, start.view(-1, kbs), table)
        else:
            _write_pages(c, t, rows, slice(None), view, rows.page_ids)
    if rows.partial.size:  # after the pages: a page this fill put in the store is there now
        blocks, s0, s1, _ = (x[rows.partial].tolist() for x in rows.rows.entries)
        for b, lo, hi, page in zip(blocks, s0, s1, rows.partial_slots.tolist()):
            view[b, 0, lo:hi].copy_(store[page, 0, lo:hi])
    if not rows.rest.size:
        return
    table, start = value_source(c, t, rows.rows, rows.rest_rows)
    if rows.per_entry:
        _fill_per_entry(view, layout, rows, table, start)
        return
    idx = rows.rest_index(t.tensor.device)
    if start is None:
        view.index_put_(idx, table[0])
        return
    n = idx[0].numel()
    windows = table.unfold(0, layout.row_size, 1)
    chunk = max(1, CHUNK_BYTES // (layout.row_size * layout.itemsize))
    buf = torch.empty(min(chunk, n), layout.row_size, dtype=table.dtype, device=view.device)
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
def _page_gather(layout: Layout, device: torch.device | None = None) -> PageGather | None:
    """How to write whole kernel-block pages with ``index_select`` straight into
    the cache, when the page holds its innermost element dim (size ``run``,
    stride 1) in rows of one contiguous region that includes the slot dim -
    vLLM CPU's ``(2, num_blocks, H, N, D)``: each of K and V is one contiguous
    ``[H, N, D]`` region.  None for other layouts.  Its index tensors are on
    ``device`` (None: the CPU, whatever torch's default device is).  Cached: a
    function of the layout and device only, asked for every tensor of every fill.
    """
    if device is not None:
        host = _page_gather(layout)
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


def _fill_pages_direct(cache, layout: Layout, ids: list[int], page_start, table) -> None:
    """Fill (normal, replay) of whole pages ``ids`` in one pass (no staging
    buffer), for layouts whose page regions of consecutive blocks are adjacent
    (``_page_gather(layout).adjacent``); ``page_start[i, s]``: the value-source
    start of page i's slot s."""
    run, elem_off, slot, loop_mem, loop_val, _ = _page_gather(layout, page_start.device)
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


PAGE_IMAGE_BYTES = 1 << 30  # default budget of PageImages, per engine


class PageImages:
    """Whole pages a launch class has written, kept to be copied again.

    A whole page's bytes are a function of its slots' positions - the
    rank-local position of slot 0 (the entry's ``local_base``) - and, when
    replaying, of the sequence; not of the request or the block.  Every
    request of a benchmark starts at position 0, so its whole pages are the
    first request's again.  Where the page path would gather and transpose
    (vLLM CPU's K pages, ``_fill_pages_staged``: ~0.3 ns per element on one
    core), a page already written is copied from a store instead, at memcpy
    speed (``bench/page_bench.py``).

    One index per class, ``(sequence, local_base) -> page of the store``, and
    a store per tensor: ``[capacity, *canonical page]`` with compact strides
    in the order of the cache's, so a copy between them runs over contiguous
    spans on both sides.  A new page is written into the store (the staged
    path, the same bytes) before it is copied; pages past ``capacity`` are
    written directly, as without a store.  A partial block (a request's last)
    copies its slots from its page when the store has it.  Stores grow with
    the pages assigned (doubling), so only pages in use take memory, and a
    fill that raises forgets the pages it assigned; ``TorchBackend.warmup``
    writes the pages of every position up front.
    """

    def __init__(self, c: LaunchClass, capacity: int):
        self.capacity = capacity
        self.replay = c.mode == V.REPLAY
        self.slots_per_page = c.layout.slots_per_kernel_block
        self.limit: int | None = None  # rank-local positions past which no page is kept (set by warmup)
        self.index: dict[tuple[int, int], int] = {}
        self.stores: dict[int, torch.Tensor] = {}  # tensor -> store of >= num_pages pages
        self._added: list[tuple[int, int]] = []  # keys assigned by the fill in progress

    @property
    def num_pages(self) -> int:
        return len(self.index)

    def nbytes(self) -> int:
        """Memory the pages written so far take, over the class's stores."""
        return sum(self.num_pages * st.stride(0) * st.element_size() for st in self.stores.values())

    def assign(self, rows: SlotRows) -> tuple[np.ndarray, np.ndarray]:
        """Per entry of ``rows``: its page in the store (-1: none) and whether
        this fill writes that page first.  Whole pages get a page while the
        store has room (and below ``limit``); other entries (a request's last,
        partial block) are copied from their page when it is there, written by
        this or an earlier fill (or ``TorchBackend.warmup``), never written on
        their own.  New pages count as written once ``commit`` is called."""
        blocks, s0, s1, _ = rows.entries
        slots = np.full(blocks.size, -1, dtype=np.int64)
        new = np.zeros(blocks.size, dtype=bool)
        whole = (s0 == 0) & (s1 == self.slots_per_page)
        limit = self.limit
        for order, create in ((np.flatnonzero(whole), True), (np.flatnonzero(~whole), False)):
            seqs = rows.entry_sequence[order].tolist() if self.replay else [0] * order.size
            for i, key in zip(order.tolist(), zip(seqs, rows.entry_base[order].tolist())):
                page = self.index.get(key)
                if page is None and create and len(self.index) < self.capacity and (
                        limit is None or key[1] + self.slots_per_page <= limit):
                    page = self.index[key] = len(self.index)
                    self._added.append(key)
                    new[i] = True
                if page is not None:
                    slots[i] = page
        return slots, new

    def commit(self) -> None:
        """The pages assigned since the last commit are written in every store."""
        self._added.clear()

    def rollback(self) -> None:
        """Forget the pages assigned since the last commit (a fill that raised
        before writing them): no later fill copies a page never written."""
        for key in self._added:
            del self.index[key]
        self._added.clear()

    def reserve(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every tensor's store (``views``: the tensors' canonical views),
        grown to hold the pages assigned so far: twice its pages or more, up
        to ``capacity``, so only pages in use take memory."""
        return [self._store(i, view) for i, view in enumerate(views)]

    def _store(self, i: int, view: torch.Tensor) -> torch.Tensor:
        """Tensor ``i``'s store: ``[pages, *canonical page]`` with compact strides in the order of ``view``'s."""
        st = self.stores.get(i)
        have = 0 if st is None else st.shape[0]
        if have >= self.num_pages:
            return st
        inner = sorted(range(1, view.dim()), key=view.stride)
        strides, span = [0] * view.dim(), 1
        for d in inner:
            strides[d] = span
            span *= view.shape[d]
        strides[0] = span
        pages = min(self.capacity, max(self.num_pages, 2 * have))
        try:
            grown = torch.empty(pages * span, dtype=view.dtype, device=view.device)
        except RuntimeError as exc:
            raise MemoryError(
                f"page images: allocating {pages * span * view.element_size() / 2**20:.0f} MiB for {pages} pages "
                f"of a store failed ({exc}); the page image budget is more than this host can give - lower "
                f"page_image_bytes (the connector's page_image_mib; 0 keeps none)") from None
        grown = grown.as_strided((pages, *view.shape[1:]), strides)
        if have:
            grown[:have].copy_(st)
        self.stores[i] = grown
        return grown


def _write_pages(c: LaunchClass, t: LayerTensor, rows: ClassRows, which, dst, dst_pages: list[int]) -> None:
    """The pages ``rows.pages[which]`` of tensor ``t``, from the value source
    through the staging buffer, into pages ``dst_pages`` of ``dst`` (the
    cache's canonical view or a ``PageImages`` store)."""
    table, start = value_source(c, t, rows.rows, rows.page_rows(which))
    _fill_pages_staged(dst, c.layout, dst_pages, start.view(-1, c.layout.slots_per_kernel_block), table)


def _fill_pages_via_store(c: LaunchClass, t: LayerTensor, rows: ClassRows, view, store) -> None:
    """Whole pages copied from ``store`` (``PageImages``): pages new to it
    written there first, pages without one (slot -1) written directly; a run
    of consecutive blocks whose store pages are consecutive too is one copy."""
    slots, ids = rows.slots, rows.page_ids
    miss = slots < 0
    new = np.flatnonzero(rows.new)
    if new.size:
        _write_pages(c, t, rows, new, store, slots[new].tolist())
    if miss.any():
        direct = np.flatnonzero(miss)
        _write_pages(c, t, rows, direct, view, [ids[i] for i in direct])
    hit = np.flatnonzero(~miss).tolist()
    p = 0
    while p < len(hit):
        q = p + 1
        while q < len(hit) and ids[hit[q]] == ids[hit[q - 1]] + 1 and slots[hit[q]] == slots[hit[q - 1]] + 1:
            q += 1
        b, s = ids[hit[p]], int(slots[hit[p]])
        view[b: b + q - p].copy_(store[s: s + q - p])
        p = q


def _fill_per_entry(view, layout: Layout, rows: ClassRows, table, start) -> None:
    """One copy (or fill) per rest entry, split at kernel blocks; ``start``:
    the rest rows' value starts."""
    kbs = layout.slots_per_kernel_block
    windows = table.unfold(0, layout.row_size, 1) if start is not None else None
    buf = None
    if windows is not None:
        buf = torch.empty(kbs, layout.row_size, dtype=table.dtype, device=view.device)
    blocks, s0, s1, _ = (x[rows.rest].tolist() for x in rows.rows.entries)
    for b, s, end, a in zip(blocks, s0, s1, rows.rest_first.tolist()):
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


def read_rows(cache: torch.Tensor, layout: Layout, rows: SlotRows) -> torch.Tensor:
    """The bits held by the planned slots: ``[num_rows, row_size]``."""
    view = canonical_view(cache, layout)
    return view[rows.index(layout, cache.device)].reshape(rows.num_rows, layout.row_size)


class TorchBackend(FillBackend):
    """Fills with torch ops: CPU caches (vLLM's CPU platform), and the tests' reference.

    ``page_image_bytes``: the budget of ``PageImages`` over all launch classes
    whose whole pages take the staged path (None: ``PAGE_IMAGE_BYTES``, 0: none).
    """

    name = "torch"

    def __init__(self, registry, page_image_bytes: int | None = None):
        super().__init__(registry)
        self.page_image_bytes = page_image_bytes = PAGE_IMAGE_BYTES if page_image_bytes is None else page_image_bytes
        staged = [c for c in registry.classes if _pages_staged(c)]
        per_page = sum(len(c.tensors) * c.layout.slots_per_kernel_block * c.layout.row_size * c.layout.itemsize
                       for c in staged)
        capacity = page_image_bytes // per_page if per_page else 0
        self.images = {id(c): PageImages(c, capacity) for c in staged} if capacity > 0 else {}

    def warmup(self, num_positions: int = 0) -> int:
        """Write the page images of every page holding global positions
        ``[0, num_positions)`` (each recorded sequence's, replaying), as far as
        the budget goes: the first requests' whole pages are copies too, and
        the stores' memory is taken at registration, not in a serving step.
        Pages past those positions are not kept after this (no request
        reaches them; a startup fill of every block would fill the budget)."""
        for c in self.registry.classes:
            images = self.images.get(id(c))
            if images is None:
                continue
            kbs = c.layout.slots_per_kernel_block
            local = int(self.registry.groups[c.group].dcp.local_count(num_positions))
            pages = -(-local // kbs)  # the last one partly: a request's last block copies its slots from it
            if pages:  # no request reaches past them: pages there are not worth keeping (startup_fill's)
                images.limit = pages * kbs
            seqs = self.registry.num_sequences if images.replay else 1
            n = min(images.capacity, pages * seqs)
            if n == 0:
                continue
            k = np.arange(n, dtype=np.int64)
            entries = GroupFill(np.zeros(n, np.int64), local_base=k % pages * kbs, sequence=k // pages)
            rows = SlotRows(entries.normalized(kbs), self.registry.groups[c.group].dcp)
            with _writing(images):
                split = ClassRows(rows, c, images)  # every entry a whole page of block 0, never written
                new = np.flatnonzero(split.new)
                stores = images.reserve([canonical_view(t.tensor, c.layout) for t in c.tensors])
                for t, store in zip(c.tensors, stores):
                    _write_pages(c, t, split, new, store, split.slots[new].tolist())
        return 0

    def describe(self) -> str:
        """The page images held, if any."""
        if not self.images:
            return ""
        held = sum(im.nbytes() for im in self.images.values())
        pages = sum(im.num_pages for im in self.images.values())
        return (f"page images: {pages} pages of {len(self.images)} launch class(es), {held / 2**20:.1f} MiB "
                f"(budget {self.page_image_bytes / 2**20:.0f} MiB)")

    def fill(self, plan: Mapping[str, GroupFill]) -> int:
        rows = {g: SlotRows(entries, self.registry.groups[g].dcp) for g, entries in plan.items()}
        for c in self.registry.classes:
            r = rows.get(c.group)
            if r is None:
                continue
            images = self.images.get(id(c))
            with _writing(images):
                split = ClassRows(r, c, images)
                stores = [None] * len(c.tensors)
                if split.slots is not None:
                    stores = images.reserve([canonical_view(t.tensor, c.layout) for t in c.tensors])
                for t, store in zip(c.tensors, stores):
                    fill_tensor(c, t, split, store)
        return 0


@contextlib.contextmanager
def _writing(images: PageImages | None):
    """Pages assigned inside count as written only if nothing raised."""
    try:
        yield
    except BaseException:
        if images is not None:
            images.rollback()
        raise
    if images is not None:
        images.commit()


def _paged(c: LaunchClass) -> bool:
    """Whether whole pages of this class are written a run of blocks at a time (``ClassRows.pages``)."""
    layout = c.layout
    return (c.mode in (V.NORMAL, V.REPLAY) and bool(layout.elem_shape) and layout.kernel_split == 1
            and layout.slots_per_kernel_block * layout.row_size * layout.itemsize >= PAGE_BYTES)


def _pages_staged(c: LaunchClass) -> bool:
    """Whether this class's whole pages go through ``_fill_pages_staged`` (where ``PageImages`` pay)."""
    if not _paged(c):
        return False
    gather = _page_gather(c.layout)
    return gather is None or not gather.adjacent
