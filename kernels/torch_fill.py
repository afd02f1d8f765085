"""Torch backend: the same fill as the Triton kernel, with torch ops.

Used for CPU caches (vLLM's CPU platform) and as the reference in tests.  It
expands the plan into one row per planned slot (``slot_rows``), builds the
rows' bits from the same value table (a row is a window of the table starting
at the row's hashed offset) and writes them through the canonical strided view
``[num_blocks, r, slots_per_kernel_block, *elem_shape]``.  This module decides
how each entry is written, once per launch class and fill (``ClassRows``), and
dispatches it: whole pages to ``torch_pages`` (gathered straight into the
cache, or staged) or copied from ``page_images`` - and so are partial blocks
whose page the store holds; other large entries to ``torch_pages``, one
strided ``copy_`` each; many small ones are chunked ``index_put_`` here.  The
bytes are identical to the Triton path's by construction.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from . import torch_pages
from . import values as V
from .backend import FillBackend
from .layout import canonical_view
from .page_images import PAGE_IMAGE_BYTES, PageImages, writing
from .plan import GroupFill
from .registry import LaunchClass, LayerTensor
from .slot_rows import SlotRows, value_source

# Entries this large (bytes) are written one strided copy each: per-call overhead
# (~10 us) is small next to the copy, and a copy beats index_put ~2x on whole
# pages of >= 256 KiB (measured: 512 KiB pages 2.2x faster, 64 KiB pages 1.5x slower).
PER_ENTRY_BYTES = 256 << 10


class ClassRows:
    """One launch class's planned rows, split by the path that writes them:
    the same for every tensor of the class, so worked out once per fill.

    ``pages``: the entries that are whole pages of >= ``torch_pages.PAGE_BYTES``
    with a value start (normal, replay; a request's every block but its
    last), written a run of blocks at a time - gathered straight into the
    cache where a layout's page regions are adjacent (``gather``), else
    through the staging buffer or, with ``PageImages``, copied from its store
    (``slots``: each page's page there, -1: none; ``new``: written there
    first by this fill).
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
        whole = ((s0 == 0) & (s1 == kbs)) if torch_pages.paged(c) else np.zeros(blocks.size, dtype=bool)
        self.pages = np.flatnonzero(whole)
        self.page_ids = blocks[self.pages].tolist()
        gather = torch_pages.page_gather(layout) if self.pages.size else None
        self.gather = gather if gather is not None and gather.adjacent else None
        self.slots = self.new = None
        self.partial = self.partial_slots = np.zeros(0, dtype=np.int64)
        rest = ~whole
        if images is not None:  # a class with images: its pages are staged (torch_pages.pages_staged), not gathered
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
            torch_pages.fill_pages_direct(t.tensor, layout, rows.page_ids, start.view(-1, kbs), table)
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
        blocks, s0, s1, _ = (x[rows.rest].tolist() for x in rows.rows.entries)
        torch_pages.fill_per_entry(view, layout, zip(blocks, s0, s1, rows.rest_first.tolist()), table, start)
        return
    idx = rows.rest_index(t.tensor.device)
    if start is None:
        view.index_put_(idx, table[0])
        return
    n = idx[0].numel()
    windows = table.unfold(0, layout.row_size, 1)
    chunk = max(1, torch_pages.CHUNK_BYTES // (layout.row_size * layout.itemsize))
    buf = torch.empty(min(chunk, n), layout.row_size, dtype=table.dtype, device=view.device)
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        vals = torch.index_select(windows, 0, start[a:b], out=buf[: b - a])
        view.index_put_(tuple(i[a:b] for i in idx), vals.view(b - a, *layout.elem_shape))


def _write_pages(c: LaunchClass, t: LayerTensor, rows: ClassRows, which, dst, dst_pages: list[int]) -> None:
    """The pages ``rows.pages[which]`` of tensor ``t``, from the value source
    through the staging buffer, into pages ``dst_pages`` of ``dst`` (the
    cache's canonical view or a ``PageImages`` store)."""
    table, start = value_source(c, t, rows.rows, rows.page_rows(which))
    torch_pages.fill_pages_staged(dst, c.layout, dst_pages, start.view(-1, c.layout.slots_per_kernel_block), table)


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


class TorchBackend(FillBackend):
    """Fills with torch ops: CPU caches (vLLM's CPU platform), and the tests' reference.

    ``page_image_bytes``: the budget of ``PageImages`` over all launch classes
    whose whole pages take the staged path (None: ``PAGE_IMAGE_BYTES``, 0: none).
    """

    name = "torch"

    def __init__(self, registry, page_image_bytes: int | None = None):
        super().__init__(registry)
        self.page_image_bytes = page_image_bytes = PAGE_IMAGE_BYTES if page_image_bytes is None else page_image_bytes
        # A bank staged from host memory keeps no pages of its rows on the device either.
        staged = [c for c in registry.classes if torch_pages.pages_staged(c)
                  and not (registry.staged is not None and c.mode == V.REPLAY)]
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
            with writing(images):
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

    def fill(self, plan: Mapping[str, GroupFill], sequences: np.ndarray | None = None) -> int:
        rows = {g: SlotRows(entries, self.registry.groups[g].dcp, sequences) for g, entries in plan.items()}
        for c in self.registry.classes:
            r = rows.get(c.group)
            if r is None:
                continue
            images = self.images.get(id(c))
            with writing(images):
                split = ClassRows(r, c, images)
                stores = [None] * len(c.tensors)
                if split.slots is not None:
                    stores = images.reserve([canonical_view(t.tensor, c.layout) for t in c.tensors])
                for t, store in zip(c.tensors, stores):
                    fill_tensor(c, t, split, store)
        return 0

