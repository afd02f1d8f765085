"""DCP-aware block planner: exactly the external slots of every KV cache group.

Pure Python over plain integers (no vLLM import), in two stages:

* ``Planner.select`` (scheduler side, once per request): which blocks of each
  group's block table hold external tokens, and which global token range they
  hold.  Rank independent, so the scheduler plans once for all ranks.
* ``Planner.rank_plan`` (worker side, once per step): the selections of all
  requests turned into one rank's fill entries - ``(block, slot_start,
  slot_end, local_base)`` per planned block, CSR per group - ready for one
  upload to ``FillEngine.fill``.

Geometry (ARCHITECTURE.md): a request's external tokens are
``[num_local_computed, num_tokens - 1)``; the last prompt token is left for the
model.  A group's block spans ``block_size * W`` global tokens where W is the
group's DCP world size (DCP-sharded full attention, MLA included) or 1 (every
other kind).  Token t lives on rank ``(t // I) % W`` at rank-local index
``l = (t // (I * W)) * I + t % I``, in block ``l // block_size`` of the table,
slot ``l % block_size``.  On rank r the external tokens are one contiguous
range of local indices, so each planned block is one slot range.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kvfill.kernels.plan import GroupFill

NULL_BLOCK_ID = 0  # vLLM's BlockPool hands out block 0 as the null block


class GroupKind(str, enum.Enum):
    FULL_ATTENTION = "full_attention"      # incl. MLA and sink full attention
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    CIRCULAR_BUFFER = "circular_buffer"
    MAMBA = "mamba"
    CROSS_ATTENTION = "cross_attention"
    OTHER = "other"


class Granularity(str, enum.Enum):
    TOKEN = "token"  # only the external slots (default)
    BLOCK = "block"  # whole blocks, as the in-tree connector does


@dataclass(frozen=True)
class GroupGeometry:
    """One KV cache group as the planner sees it."""

    name: str
    kind: GroupKind
    block_size: int          # tokens per block per rank (the spec's block size)
    dcp_world_size: int = 1  # W of this group: > 1 only for DCP-sharded full attention
    interleave: int = 1      # I: DCP interleave, divides block_size
    zero_fill: bool = False  # packed encodings / int metadata: zeros, not values

    def __post_init__(self):
        if not isinstance(self.kind, GroupKind):
            object.__setattr__(self, "kind", GroupKind(self.kind))
        for what, v in (("block_size", self.block_size), ("dcp_world_size", self.dcp_world_size),
                        ("interleave", self.interleave)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"group {self.name!r}: {what} must be an int >= 1, got {v!r}")
        if self.dcp_world_size > 1 and self.kind != GroupKind.FULL_ATTENTION:
            raise ValueError(
                f"group {self.name!r}: only full attention is DCP-sharded, got kind "
                f"{self.kind.value} with dcp_world_size {self.dcp_world_size}"
            )
        if self.block_size % self.interleave:
            raise ValueError(
                f"group {self.name!r}: interleave {self.interleave} does not divide the "
                f"block size {self.block_size}"
            )

    @property
    def span(self) -> int:
        """Global tokens covered by one block id (block_size x W)."""
        return self.block_size * self.dcp_world_size

    @property
    def whole_blocks(self) -> bool:
        """Kinds whose every allocated block is filled whole (no token range)."""
        return self.kind in (GroupKind.CIRCULAR_BUFFER, GroupKind.CROSS_ATTENTION)

    @property
    def zero(self) -> bool:
        return self.zero_fill or self.kind == GroupKind.CIRCULAR_BUFFER


@dataclass(slots=True)  # not frozen: built per request per group on the scheduler's hot path
class GroupSelection:
    """The blocks of one group of one request that hold external tokens.

    ``block_ids[j]`` is entry ``first_block + j`` of the request's block table
    (null blocks kept, as NULL id, so positions stay right); the global tokens
    to fill are ``[token_lo, token_hi)``.  Whole-block kinds and block
    granularity fill every slot of their non-null blocks.
    """

    first_block: int
    block_ids: Sequence[int]  # a tuple/list, or an int64 array from the vLLM adapter
    token_lo: int
    token_hi: int
    whole: bool = False


@dataclass(slots=True)
class RequestSelection:
    req_id: str
    num_external_tokens: int
    groups: tuple[GroupSelection, ...]

    def intree_view(self, null_block_id: int = NULL_BLOCK_ID) -> tuple[tuple[list[int], ...], int]:
        """``(block_ids_per_group, num_external_tokens)`` as the in-tree metadata has it."""
        return (
            tuple(_non_null(g.block_ids, null_block_id) for g in self.groups),
            self.num_external_tokens,
        )


def _non_null(ids: Sequence[int], null_block_id: int) -> list[int]:
    if isinstance(ids, list) and null_block_id not in ids:  # the common case: no copy
        return ids
    return [int(b) for b in ids if b != null_block_id]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def local_count(n: np.ndarray | int, world: int, rank: int, interleave: int):
    """How many of the global tokens ``[0, n)`` live on ``rank``."""
    if world == 1:
        return n
    period = interleave * world
    return (n // period) * interleave + np.clip(n % period - rank * interleave, 0, interleave)


@dataclass
class GroupEntries:
    """One group's planned entries on one rank, CSR over requests."""

    block_ids: np.ndarray
    slot_start: np.ndarray
    slot_end: np.ndarray
    local_base: np.ndarray
    req_indptr: np.ndarray  # entries of request i: [req_indptr[i], req_indptr[i + 1])

    @property
    def num_entries(self) -> int:
        return int(self.block_ids.size)

    @property
    def num_slots(self) -> int:
        return int((self.slot_end - self.slot_start).sum())

    def fill(self) -> GroupFill:
        return GroupFill(self.block_ids, self.slot_start, self.slot_end, self.local_base)


@dataclass
class StepPlan:
    """One step's fill on one rank: entries per group (by group name)."""

    req_ids: list[str]
    groups: dict[str, GroupEntries] = field(default_factory=dict)

    def fill_plan(self) -> dict[str, GroupFill]:
        return {name: g.fill() for name, g in self.groups.items() if g.num_entries}

    @property
    def num_entries(self) -> int:
        return sum(g.num_entries for g in self.groups.values())


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
        for geo, table in zip(self.groups, block_ids):
            if geo.whole_blocks:
                selections.append(GroupSelection(0, ids_of(table), 0, 0, whole=True))
                continue
            first = lo // geo.span
            end = _cdiv(hi, geo.span) if hi > lo else first
            if end > len(table):
                raise ValueError(
                    f"request {req_id!r}, group {geo.name!r}: tokens [{lo}, {hi}) need blocks "
                    f"[{first}, {end}) of span {geo.span} (block_size {geo.block_size} x "
                    f"W {geo.dcp_world_size}), but only {len(table)} are allocated"
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
        return RequestSelection(req_id, hi - lo, tuple(selections))

    # ------------------------------------------------------------ worker side
    def rank_plan(self, selections: Sequence[RequestSelection], dcp_rank: int = 0) -> StepPlan:
        """The entries one rank fills for the given requests (all groups).

        Vectorised over all requests of the step: one numpy conversion of the
        selected block ids per group, then array arithmetic.
        """
        plan = StepPlan([s.req_id for s in selections])
        num_req = len(selections)
        for gi, geo in enumerate(self.groups):
            W, I, bs = geo.dcp_world_size, geo.interleave, geo.block_size
            if W > 1 and not 0 <= dcp_rank < W:
                raise ValueError(f"group {geo.name!r}: DCP rank {dcp_rank} outside [0, {W})")
            rank = dcp_rank if W > 1 else 0
            sels = [sel.groups[gi] for sel in selections]
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
                llo = local_count(lo, W, rank, I)[req]
                lhi = local_count(hi, W, rank, I)[req]
                start = np.where(whole, 0, np.clip(llo - base, 0, bs))
                end = np.where(whole, bs, np.clip(lhi - base, 0, bs))
            keep = (ids != self.null_block_id) & (end > start)
            indptr = np.zeros(num_req + 1, np.int64)
            np.cumsum(np.bincount(req[keep], minlength=num_req), out=indptr[1:])
            plan.groups[geo.name] = GroupEntries(
                ids[keep], start[keep], end[keep], base[keep], req_indptr=indptr
            )
        return plan
