"""DCP-aware block planner: exactly the external slots of every KV cache group.

Pure Python over plain integers (no vLLM import: ``specs.py`` adapts vLLM's
types to it), in two stages:

* ``Planner.select`` (scheduler side, once per request): which blocks of each
  group's block table hold external tokens, and which global token range they
  hold.  Rank independent, so the scheduler plans once for all ranks.
* ``Planner.plan`` (worker side, once per step): the selections of all
  requests turned into the ``FillPlan`` one rank's engine fills - entries
  ``(block, slot_start, slot_end, local_base)`` per group, blocks of caches
  that hold several tokens per slot remapped to whole blocks, and a block
  shared by two requests of the step planned once.  The connector, the demo,
  the README and the tests all call this one function.

Geometry (ARCHITECTURE.md): a request's external tokens are
``[num_local_computed, num_tokens - 1)``; the last prompt token is left for the
model.  A group's block spans ``block_size * W`` global tokens where W is the
group's DCP world size as vLLM resolves it per spec (``specs.py``; 1 without
DCP or for unsharded specs).  Token t lives on rank ``(t // I) % W`` at rank-local index
``l = (t // (I * W)) * I + t % I``, in block ``l // block_size`` of the table,
slot ``l % block_size``.  On rank r the external tokens are one contiguous
range of local indices, so each planned block is one slot range.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Collection, Iterable, Sequence

import numpy as np

from kvfill.kernels import FillPlan, GroupFill

from .geometry import (  # noqa: F401  (the planner's names, importable from here)
    NULL_BLOCK_ID, RECORDED_KINDS, Granularity, GroupGeometry, GroupKind, GroupSelection, RequestSelection,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Planner:
    """Plans fills for a fixed set of KV cache groups (see module docstring)."""

    def __init__(
        self,
        groups: Sequence[GroupGeometry],
        *,
        granularity: Granularity | str = Granularity.TOKEN,
        null_block_id: int = NULL_BLOCK_ID,
    ):
        self.groups = tuple(groups)
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")
        self.granularity = Granularity(granularity)
        self.null_block_id = null_block_id

    # ------------------------------------------------------------ scheduler side
    def select(
        self,
        req_id: str,
        num_tokens: int,
        num_local_computed: int,
        block_ids: Sequence[Sequence[Any]],
        ids_of: Callable[[Sequence[Any]], Sequence[int]] = tuple,
        num_external: int | None = None,
        skip_groups: Collection[int] = (),
        sequence: int = 0,
        sequences_at: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> RequestSelection:
        """Select the external blocks of one request in every group.

        ``block_ids[g]``: group g's block table of the request (null blocks as
        ``null_block_id``), or any sequence that ``ids_of`` turns into block
        ids - only the selected slice is converted (vLLM's ``KVCacheBlock``
        lists: ``ids_of=lambda bs: tuple(b.block_id for b in bs)``).  Raises
        ValueError naming the request, group and numbers when the table is too
        short or the counts are inconsistent.  ``num_external``: fill only
        ``[num_local_computed, num_local_computed + num_external)`` (a grant the
        scheduler trimmed); default: up to the last prompt token.
        ``skip_groups``: indices of groups not to fill (filled at startup):
        they get an empty selection and their tables are not looked at.
        ``sequence``: the bank sequence a replay fill writes for this request;
        ``sequences_at``: instead, per block, ``ends -> sequences`` where a
        block's end is ``min(the block's last position + 1, num_tokens)``
        (``BankIndex.sequences_for`` of the request's tokens: a block's rows
        are a function of its own tokens, as prefix caching needs - not of
        where this request's fill ends, which the last prompt token and a
        trimmed grant move).
        """
        if not (isinstance(num_tokens, int) and isinstance(num_local_computed, int)):
            raise ValueError(f"request {req_id!r}: token counts must be ints")
        if num_tokens < 0 or num_local_computed < 0:
            raise ValueError(
                f"request {req_id!r}: negative token count (num_tokens={num_tokens}, "
                f"num_local_computed={num_local_computed})"
            )
        lo, hi = num_local_computed, num_tokens - 1
        if lo > max(hi, 0):
            raise ValueError(
                f"request {req_id!r}: num_local_computed={num_local_computed} exceeds the "
                f"{max(hi, 0)} tokens before the last prompt token (num_tokens={num_tokens})"
            )
        hi = max(hi, lo)
        if num_external is not None:
            if not 0 <= num_external <= hi - lo:
                raise ValueError(
                    f"request {req_id!r}: num_external={num_external} outside [0, {hi - lo}] "
                    f"(num_tokens={num_tokens}, num_local_computed={num_local_computed})"
                )
            hi = lo + num_external
        if len(block_ids) != len(self.groups):
            raise ValueError(
                f"request {req_id!r}: block ids for {len(block_ids)} groups, the planner has "
                f"{len(self.groups)} ({[g.name for g in self.groups]})"
            )
        selections = []
        for gi, (geo, table) in enumerate(zip(self.groups, block_ids)):
            if gi in skip_groups:
                selections.append(GroupSelection(0, (), lo, lo))
                continue
            if geo.whole_blocks:
                selections.append(GroupSelection(0, ids_of(table), 0, 0, whole=True))
                continue
            if geo.kind == GroupKind.MAMBA:
                selections.append(_state_block(req_id, geo, table, ids_of, lo, hi, num_tokens))
                continue
            first = lo // geo.span
            end = _cdiv(hi, geo.span) if hi > lo else first
            if end > len(table):
                raise ValueError(
                    f"request {req_id!r}, group {geo.name!r}: tokens [{lo}, {hi}) need blocks "
                    f"[{first}, {end}) of span {geo.span} (block_size {geo.block_size} x "
                    f"W {geo.dcp.world_size}), but only {len(table)} are allocated"
                )
            selections.append(
                GroupSelection(
                    first,
                    ids_of(table[first:end]),
                    lo,
                    hi,
                    whole=self.granularity == Granularity.BLOCK,
                )
            )
        if sequences_at is not None:
            _assign_sequences(self.groups, selections, sequences_at, num_tokens)
        return RequestSelection(req_id, hi - lo, tuple(selections), sequence)

    def for_rank(self, rank: int) -> "Planner":
        """This planner with every DCP-sharded group seen from ``rank``."""
        return Planner([replace(g, dcp=g.dcp.on_rank(rank)) for g in self.groups],
                       granularity=self.granularity, null_block_id=self.null_block_id)

    # ------------------------------------------------------------ worker side
    def plan(self, selections: Sequence[RequestSelection], groups: Iterable[str] | None = None) -> FillPlan:
        """The ``FillPlan`` this planner's rank fills for the given requests.

        ``groups``: plan only these groups (default: all; a worker passes the
        groups its engine registered).  Per group: the rank-local entries of
        every request in request order, remapped to whole blocks where the
        caches hold several tokens per slot, a repeated entry (a block shared
        by two requests of the step) kept once; groups without entries are
        left out.  Raises ValueError naming a request whose selection has
        another group count.
        """
        for sel in selections:
            if len(sel.groups) != len(self.groups):
                raise ValueError(
                    f"request {sel.req_id!r} has block ids for {len(sel.groups)} groups, "
                    f"the planner has {len(self.groups)} ({[g.name for g in self.groups]})"
                )
        wanted = None if groups is None else set(groups)
        out = {}
        for gi, geo in enumerate(self.groups):
            if wanted is not None and geo.name not in wanted:
                continue
            entries = _rank_entries(geo, [sel.groups[gi] for sel in selections],
                                    [sel.sequence for sel in selections], self.null_block_id)
            if geo.remaps_to_whole_blocks:
                entries = _whole_blocks(entries, geo.block_size, geo.slots_per_block)
            entries = _unique(entries)
            if entries.num_entries:
                out[geo.name] = entries
        return FillPlan(out)


def _state_block(req_id, geo: GroupGeometry, table, ids_of, lo: int, hi: int, num_tokens: int) -> GroupSelection:
    """A state group's selection: the one block its kernels read the state
    from in the request's next step - the block of the request's last token
    (vLLM's ``mamba_get_block_table_tensor``: block 0 with ``mamba_cache_mode``
    none, whose block spans ``max_model_len``; the running block with
    ``align``, where the blocks before it are null) - when anything is filled."""
    if hi <= lo:
        return GroupSelection(0, (), lo, lo)
    k = (num_tokens - 1) // geo.span
    if k >= len(table):
        raise ValueError(f"request {req_id!r}, state group {geo.name!r}: the state block of position "
                         f"{num_tokens - 1} is block {k} of span {geo.span}, but only {len(table)} are allocated")
    return GroupSelection(k, ids_of(table[k:k + 1]), lo, hi)


def wrapped_positions(groups: Sequence[GroupGeometry], selections: Sequence[GroupSelection], lengths) -> int:
    """How many of a request's filled positions replay a sequence past its
    recorded length (``lengths[s]``: there a sequence wraps, row ``t mod
    N_s``: ``kvfill/bank/format.py``): per group, each block's global
    positions ``>=`` its sequence's length; the most over the groups (each
    fills the same positions, a sliding window fewer)."""
    lengths = np.asarray(lengths, np.int64)
    most = 0
    for geo, sel in zip(groups, selections):
        if sel.sequences is None or geo.whole_blocks or geo.kind == GroupKind.MAMBA or not len(sel.block_ids):
            continue
        k = sel.first_block + np.arange(len(sel.block_ids), dtype=np.int64)
        lo = np.maximum(k * geo.span, sel.token_lo)
        hi = np.minimum((k + 1) * geo.span, sel.token_hi)
        start = np.maximum(lo, lengths[np.asarray(sel.sequences, np.int64)])
        most = max(most, int(np.clip(hi - start, 0, None).sum()))
    return most


def _assign_sequences(groups: Sequence[GroupGeometry], selections: list[GroupSelection],
                      sequences_at: Callable[[np.ndarray], np.ndarray], num_tokens: int) -> None:
    """Each token-range selection's per-block sequences, from one call of
    ``sequences_at`` over the distinct block ends of all groups (a block's
    end capped at the request's ``num_tokens``)."""
    ends = {}
    for gi, (geo, sel) in enumerate(zip(groups, selections)):
        if geo.whole_blocks or not len(sel.block_ids):  # block granularity too: its blocks have ends
            continue
        k = sel.first_block + np.arange(len(sel.block_ids), dtype=np.int64)
        ends[gi] = np.minimum((k + 1) * geo.span, num_tokens)
    if not ends:
        return
    uniq = np.unique(np.concatenate(list(ends.values())))
    seqs = np.asarray(sequences_at(uniq), dtype=np.int64)
    for gi, e in ends.items():
        selections[gi].sequences = seqs[np.searchsorted(uniq, e)]


def _rank_entries(geo: GroupGeometry, sels: Sequence[GroupSelection], sequences: Sequence[int],
                  null_block_id: int) -> GroupFill:
    """One group's entries on ``geo.dcp.rank``, request after request (each
    entry carrying its request's bank sequence).

    Vectorised over all requests of the step: one numpy conversion of the
    selected block ids, then array arithmetic.
    """
    num_req, bs = len(sels), geo.block_size
    lens = np.fromiter((len(g.block_ids) for g in sels), np.int64, num_req)
    ids = np.concatenate([np.asarray(g.block_ids, np.int64) for g in sels] or [np.zeros(0, np.int64)])
    req = np.repeat(np.arange(num_req, dtype=np.int64), lens)
    first = np.fromiter((g.first_block for g in sels), np.int64, num_req)
    lo = np.fromiter((g.token_lo for g in sels), np.int64, num_req)
    hi = np.fromiter((g.token_hi for g in sels), np.int64, num_req)
    whole = np.fromiter((g.whole for g in sels), bool, num_req)[req]
    # Table index of each selected block.
    k = first[req] + np.arange(ids.size, dtype=np.int64) - (np.cumsum(lens) - lens)[req]
    base = k * bs
    if geo.kind == GroupKind.MAMBA:
        # A state row summarises the prompt up to its last external token.
        start = np.zeros(ids.size, np.int64)
        end = np.ones(ids.size, np.int64)
        base = np.maximum(hi - 1, 0)[req]
    else:
        llo = geo.dcp.local_count(lo)[req]
        lhi = geo.dcp.local_count(hi)[req]
        start = np.where(whole, 0, np.clip(llo - base, 0, bs))
        end = np.where(whole, bs, np.clip(lhi - base, 0, bs))
    keep = (ids != null_block_id) & (end > start)
    if any(g.sequences is not None for g in sels):
        seq = np.concatenate([np.asarray(g.sequences, np.int64) if g.sequences is not None
                              else np.full(len(g.block_ids), s, np.int64) for g, s in zip(sels, sequences)])
    else:
        seq = np.asarray(sequences, np.int64).reshape(num_req)[req]
    return GroupFill(ids[keep], start[keep], end[keep], base[keep], seq[keep])


def _whole_blocks(entries: GroupFill, tokens_per_block: int, slots_per_block: int) -> GroupFill:
    """Every slot of each planned block, block k of the table holding slots
    ``[k * slots_per_block, (k + 1) * slots_per_block)``."""
    return GroupFill(
        entries.block_ids,
        np.zeros_like(entries.slot_start),
        np.full_like(entries.slot_end, slots_per_block),
        entries.local_base // tokens_per_block * slots_per_block,
        entries.sequence,
    )


def _unique(entries: GroupFill) -> GroupFill:
    """Drop repeated entries (a block shared by requests of one step is filled once).

    Repeats are rare, so they are looked for with a 1-D sort of the block ids
    (~7 ms for 1.2M entries); the row-wise unique (~100x slower) runs only
    when some block id does repeat.
    """
    ids = np.sort(entries.block_ids)
    if ids.size < 2 or not (ids[1:] == ids[:-1]).any():
        return entries
    # Every entry of a shared block replays the sequence of the block's first
    # entry: slots two entries overlap then get the same bytes from both.
    _, first, inverse = np.unique(entries.block_ids, return_index=True, return_inverse=True)
    sequence = entries.sequence[first][inverse.reshape(-1)]
    uniq, keep = np.unique(entries.columns(), axis=0, return_index=True)
    return GroupFill(uniq[:, 0], uniq[:, 1], uniq[:, 2], uniq[:, 3], sequence[keep])
