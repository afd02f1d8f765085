"""The planner's vocabulary: what a KV cache group is (kind, block size, DCP
geometry) and what a selection of a request's blocks is - plain frozen data,
no vLLM import (``specs.py`` builds these from vLLM's types).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence

from kvfill.bank import NO_DCP, DcpGeometry

NULL_BLOCK_ID = 0  # vLLM's BlockPool hands out block 0 as the null block


class GroupKind(str, enum.Enum):
    FULL_ATTENTION = "full_attention"      # incl. MLA and sink full attention
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    CIRCULAR_BUFFER = "circular_buffer"
    MAMBA = "mamba"
    CROSS_ATTENTION = "cross_attention"
    OTHER = "other"


# Groups whose slots hold one token position each: recorded into banks and replayed.
RECORDED_KINDS = (GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW)


class Granularity(str, enum.Enum):
    TOKEN = "token"  # only the external slots (default)
    BLOCK = "block"  # whole blocks, as the in-tree connector does


@dataclass(frozen=True)
class GroupGeometry:
    """One KV cache group as the planner sees it.

    ``block_size``: tokens per block per rank (the spec's block size);
    ``dcp``: the group's DCP geometry (W as vLLM resolves it per spec:
    ``specs.dcp_world_size_of``; the rank matters only to ``Planner.plan``);
    ``slots_per_block``: slots the group's caches hold per block, when that
    differs from ``block_size`` (several tokens per slot, e.g. compressed MLA):
    its planned blocks are then filled whole.
    """

    name: str
    kind: GroupKind
    block_size: int
    dcp: DcpGeometry = NO_DCP
    zero_fill: bool = False  # packed encodings / int metadata: zeros, not values
    slots_per_block: int | None = None

    def __post_init__(self):
        if not isinstance(self.kind, GroupKind):
            object.__setattr__(self, "kind", GroupKind(self.kind))
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"group {self.name!r}: block_size must be an int >= 1, got {self.block_size!r}")
        if not isinstance(self.dcp, DcpGeometry):
            raise TypeError(f"group {self.name!r}: dcp must be a DcpGeometry, got {type(self.dcp).__name__}")
        if self.dcp.sharded and self.kind == GroupKind.MAMBA:
            raise ValueError(
                f"group {self.name!r}: Mamba state is not sharded by DCP, got DCP world size {self.dcp.world_size}"
            )
        if self.block_size % self.dcp.interleave:
            raise ValueError(
                f"group {self.name!r}: interleave {self.dcp.interleave} does not divide the "
                f"block size {self.block_size}"
            )

    @property
    def span(self) -> int:
        """Global tokens covered by one block id (block_size x W)."""
        return self.block_size * self.dcp.world_size

    @property
    def whole_blocks(self) -> bool:
        """Kinds whose every allocated block is filled whole (no token range)."""
        return self.kind in (GroupKind.CIRCULAR_BUFFER, GroupKind.CROSS_ATTENTION)

    @property
    def zero(self) -> bool:
        return self.zero_fill or self.kind == GroupKind.CIRCULAR_BUFFER

    @property
    def remaps_to_whole_blocks(self) -> bool:
        """Token slots don't map 1:1 onto this group's caches: fill planned blocks whole."""
        return self.kind != GroupKind.MAMBA and self.slots_per_block not in (None, self.block_size)


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
    sequences: Any = None  # replaying: the bank sequence of each of block_ids (None: the request's)


@dataclass(slots=True)
class RequestSelection:
    """One request's selections; ``sequence``: the bank sequence it replays (0 otherwise)."""

    req_id: str
    num_external_tokens: int
    groups: tuple[GroupSelection, ...]
    sequence: int = 0

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
