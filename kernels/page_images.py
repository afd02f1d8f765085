"""Page images (torch backend): a store of the whole pages a launch class has
written, kept to be copied again.  Where the page path would gather and
transpose (vLLM CPU's K pages), a later request at the same positions copies
its whole pages - and its last, partial block's slots - from the store at
memcpy speed instead; the pages are written once, by the staging path, into
the store.  This module keeps the store and its index (``PageImages``) and
the rule that pages count as written only when their fill did not raise
(``writing``); ``torch_fill`` decides which entries use it.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from . import values as V
from .registry import LaunchClass
from .slot_rows import SlotRows

PAGE_IMAGE_BYTES = 1 << 30  # default budget of PageImages, per engine


class PageImages:
    """Whole pages a launch class has written, kept to be copied again.

    A whole page's bytes are a function of its slots' positions - the
    rank-local position of slot 0 (the entry's ``local_base``) - and, when
    replaying, of the sequence; not of the request or the block.  Every
    request of a benchmark starts at position 0, so its whole pages are the
    first request's again.  Where the page path would gather and transpose
    (vLLM CPU's K pages, ``torch_pages.fill_pages_staged``: ~0.3 ns per
    element on one core), a page already written is copied from a store
    instead, at memcpy speed (``bench/page_bench.py``).

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


@contextlib.contextmanager
def writing(images: PageImages | None):
    """Pages assigned inside count as written only if nothing raised."""
    try:
        yield
    except BaseException:
        if images is not None:
            images.rollback()
        raise
    if images is not None:
        images.commit()

