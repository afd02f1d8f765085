"""Recurrent state replayed into state blocks (a bank's state section,
``kvfill/bank/state.py``).

A state layer's cache (vLLM's ``MambaSpec`` layers) holds one page per
block: the layer's state tensors' bytes one after another.  A request's
state block takes the whole recorded state of the sequence it replays:
one page copy per block, gathered from the bank's ``[S, page bytes]`` rows
and scattered into the blocks with one indexed copy per layer (torch, any
device).  No position is involved: a state summarises every position the
fill wrote.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from .host_copy import upload


@dataclass(frozen=True)
class StateWrite:
    """What one ``StatePages.write`` did: pages and bytes written, device
    work issued (one upload of every layer's indices, then a gather and a
    scatter per layer)."""

    pages: int
    bytes: int
    launches: int


def page_rows(cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, page bytes]``: a state cache's pages as rows, a view of
    it (vLLM registers ``[num_blocks, 1, 1, bytes]`` of int8)."""
    rows = cache.view(cache.shape[0], -1) if cache.dim() > 2 else cache
    if rows.element_size() != 1 or rows.stride(1) != 1:
        raise ValueError(f"a state cache of shape {list(cache.shape)}, dtype {cache.dtype} and strides "
                         f"{list(cache.stride())} is not one row of bytes per block")
    return rows


class StatePages:
    """The state caches of an engine's state layers and, replaying, each
    layer's recorded states ``[S, page bytes]`` on the caches' device."""

    def __init__(self, caches: Mapping[str, torch.Tensor], states: Mapping[str, torch.Tensor] | None = None):
        self.rows = {name: page_rows(c) for name, c in caches.items()}
        self.states: dict[str, torch.Tensor] = {}
        for name, s in (states or {}).items():
            rows = self.rows.get(name)
            if rows is None:
                raise ValueError(f"state layer {name!r} has recorded states but no cache here")
            if s.dim() != 2 or s.shape[1] != rows.shape[1] or s.element_size() != 1:
                raise ValueError(f"state layer {name!r}: recorded states {list(s.shape)} of {s.dtype}; its pages "
                                 f"hold {rows.shape[1]} bytes")
            self.states[name] = s.to(rows.device).view(rows.dtype).contiguous()

    @property
    def num_sequences(self) -> int:
        return min((s.shape[0] for s in self.states.values()), default=0)

    def check(self, blocks: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> list:
        """ValueError naming the layer for a block id outside its cache or a
        sequence outside the bank; else the writes ``write`` makes."""
        staged = []
        for name, (ids, seqs) in blocks.items():
            st = self.states.get(name)
            if st is None:
                continue
            ids, seqs = np.asarray(ids, np.int64), np.asarray(seqs, np.int64)
            rows = self.rows[name]
            if ids.size and (ids.min() < 0 or ids.max() >= rows.shape[0]):
                raise ValueError(f"state layer {name!r}: block ids {ids.tolist()[:8]} outside its "
                                 f"{rows.shape[0]} blocks")
            if seqs.size and (seqs.min() < 0 or seqs.max() >= st.shape[0]):
                raise ValueError(f"state layer {name!r}: sequences {seqs.tolist()[:8]} outside the bank's "
                                 f"{st.shape[0]}")
            if ids.size:
                staged.append((rows, st, ids, seqs))
        return staged

    def write(self, blocks: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> StateWrite:
        """Write each layer's recorded state of ``sequence[i]`` into block
        ``block_ids[i]`` (``blocks``: layer -> (block_ids, sequences)), after
        checking every layer's (``check``): nothing is written when one is
        bad.  Stream-ordered, no host sync: the indices of every layer go up
        in one copy (pinned and non-blocking for a GPU; the layers of one
        group share theirs), then each layer is one gather and one scatter."""
        staged = self.check(blocks)
        if not staged:
            return StateWrite(0, 0, 0)
        dev = staged[0][0].device
        arrays, offsets, where = [], {}, []
        for _, _, ids, seqs in staged:
            key = (ids.tobytes(), seqs.tobytes())
            if key not in offsets:
                offsets[key] = sum(len(a) for a in arrays)
                arrays += [ids, seqs]
            where.append(offsets[key])
        index = upload(torch.from_numpy(np.concatenate(arrays)), dev)  # pinned, non-blocking
        pages = nbytes = 0
        for (rows, st, ids, _), at in zip(staged, where):
            n = len(ids)
            rows.index_copy_(0, index[at:at + n], st.index_select(0, index[at + n:at + 2 * n]))
            pages += n
            nbytes += n * rows.shape[1]
        return StateWrite(pages, nbytes, 1 + 2 * len(staged))

    def read(self, name: str, block_ids) -> torch.Tensor:
        """``[n, page bytes]`` (uint8, host): what the blocks hold now."""
        rows = self.rows[name]
        ids = torch.as_tensor(np.asarray(block_ids, np.int64)).to(rows.device)
        return rows[ids].view(torch.uint8).cpu()

    def mismatches(self, blocks: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> tuple[int, int, list]:
        """(pages checked, pages differing, the first few (layer, block,
        sequence)) after ``write(blocks)``: every page byte compared."""
        checked, bad, first = 0, 0, []
        for name, (ids, seqs) in blocks.items():
            st = self.states.get(name)
            if st is None or not len(ids):
                continue
            dev = st.device
            got = self.rows[name][torch.as_tensor(np.asarray(ids, np.int64)).to(dev)]
            want = st[torch.as_tensor(np.asarray(seqs, np.int64)).to(dev)]
            differs = (got != want).any(dim=1).cpu().numpy()
            checked += len(ids)
            bad += int(differs.sum())
            first += [(name, int(ids[i]), int(seqs[i])) for i in np.flatnonzero(differs)[:8 - len(first)]]
        return checked, bad, first
