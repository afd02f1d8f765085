"""Fill plans: which slots of which blocks of each cache group to fill.

A plan is CSR-like per group: one *entry* per (block, slot range), as four
parallel integer arrays - the form the planner produces and the kernels read
after one upload of ``int32[num_entries, 4]`` (16 bytes per planned block):

    block_ids[i]   manager block id (index along the block dim)
    slot_start[i]  first slot of the block to write              (0 <= start)
    slot_end[i]    one past the last slot to write               (end <= block_size)
    local_base[i]  rank-local token index held by slot 0 of the block; the
                   slot ``s`` holds local index ``l = local_base + s`` and the
                   global position ``t = (l // I) * (I * W) + r * I + l % I``
                   under DCP (W ranks, interleave I, this rank r), ``t = l``
                   without DCP.

For a request whose block table is ``[b0, b1, ...]`` and whose rank-local
external slots are ``[lo, hi)``, the entries are the blocks overlapping
``[lo, hi)`` with ``local_base = k * block_size`` for the k-th block.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch


def _as_i64(x, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


@dataclass(frozen=True)
class GroupFill:
    """The planned entries of one cache group (see module docstring).

    ``slot_start``/``slot_end``/``local_base`` default to whole blocks holding
    consecutive tokens: entry i covers slots ``[0, block_size)`` and tokens
    ``[i * block_size, (i + 1) * block_size)``.
    """

    block_ids: Sequence[int] | np.ndarray | torch.Tensor
    slot_start: Sequence[int] | np.ndarray | torch.Tensor | None = None
    slot_end: Sequence[int] | np.ndarray | torch.Tensor | None = None
    local_base: Sequence[int] | np.ndarray | torch.Tensor | None = None

    def arrays(self, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(block_ids, slot_start, slot_end, local_base)`` as int64 arrays."""
        blocks = _as_i64(self.block_ids, "block_ids")
        n = blocks.size
        start = np.zeros(n, np.int64) if self.slot_start is None else _as_i64(self.slot_start, "slot_start")
        end = np.full(n, block_size, np.int64) if self.slot_end is None else _as_i64(self.slot_end, "slot_end")
        base = (
            np.arange(n, dtype=np.int64) * block_size
            if self.local_base is None
            else _as_i64(self.local_base, "local_base")
        )
        for name, a in (("slot_start", start), ("slot_end", end), ("local_base", base)):
            if a.size != n:
                raise ValueError(f"{name} has {a.size} entries, block_ids has {n}")
        return blocks, start, end, base

    @property
    def num_entries(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class FillPlan:
    """A step's fill: entries per registered group name."""

    groups: Mapping[str, GroupFill] = field(default_factory=dict)

    @staticmethod
    def of(plan: "FillPlan | Mapping[str, GroupFill]") -> "FillPlan":
        return plan if isinstance(plan, FillPlan) else FillPlan(dict(plan))


def validate_entries(
    group: str,
    blocks: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    base: np.ndarray,
    *,
    num_blocks: int,
    block_size: int,
) -> None:
    """Raise ValueError naming the group, the first bad entry and the bound."""

    def first_bad(mask: np.ndarray, what: str, expected: str) -> None:
        if mask.any():
            i = int(np.flatnonzero(mask)[0])
            raise ValueError(
                f"group {group!r} entry {i} (block {int(blocks[i])}, slots "
                f"[{int(start[i])}, {int(end[i])}), local_base {int(base[i])}): {what}; "
                f"expected {expected}"
            )

    first_bad((blocks < 0) | (blocks >= num_blocks), "block id out of range", f"0 <= block id < {num_blocks}")
    first_bad(
        (start < 0) | (end > block_size) | (start > end),
        "slot range outside the block",
        f"0 <= slot_start <= slot_end <= block_size {block_size}",
    )
    first_bad(base < 0, "negative local_base", "local_base >= 0")
    first_bad(base + end > np.iinfo(np.int32).max, "token index past 2**31", "local_base + slot_end < 2**31")
