"""Fill plans: which slots of which blocks of each cache group to fill.

A group's plan is a list of *entries*, one per (block, slot range), held as
four parallel integer arrays - the form the planner produces and the kernels
read after one upload of ``int32[num_entries, 4]`` (16 bytes per entry):

    block_ids[i]   manager block id (index along the block dim)
    slot_start[i]  first slot of the block to write          (0 <= start)
    slot_end[i]    one past the last slot to write           (end <= slots per block)
    local_base[i]  rank-local token index held by slot 0 of the block; slot
                   ``s`` holds local index ``l = local_base + s``, i.e. global
                   position ``DcpGeometry.global_positions(l)``.
    sequence[i]    replay only: which recorded sequence of the bank the
                   entry's rows come from (``bank.py``); 0 otherwise.  Uploaded
                   as a fifth column only when some launch class replays.

For a request whose block table is ``[b0, b1, ...]`` and whose rank-local
external slots are ``[lo, hi)``, the entries are the blocks overlapping
``[lo, hi)`` with ``local_base = k * slots_per_block`` for the k-th block.
Entries may repeat or overlap where they agree on what a slot holds (same
``local_base`` and ``sequence``); two entries that would write one slot with
other values are refused (``GroupFill.validate``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

IntArray = Sequence[int] | np.ndarray | torch.Tensor


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
    """The entries of one cache group (see module docstring).

    ``slot_start``/``slot_end``/``local_base`` default to whole blocks holding
    consecutive tokens: entry i covers every slot and the tokens
    ``[i * slots_per_block, (i + 1) * slots_per_block)``; ``sequence`` to 0.
    """

    block_ids: IntArray
    slot_start: IntArray | None = None
    slot_end: IntArray | None = None
    local_base: IntArray | None = None
    sequence: IntArray | None = None

    def normalized(self, slots_per_block: int) -> "GroupFill":
        """The same entries as four int64 arrays of equal length, defaults filled in."""
        blocks = _as_i64(self.block_ids, "block_ids")
        n = blocks.size
        start = np.zeros(n, np.int64) if self.slot_start is None else _as_i64(self.slot_start, "slot_start")
        end = np.full(n, slots_per_block, np.int64) if self.slot_end is None else _as_i64(self.slot_end, "slot_end")
        base = (
            np.arange(n, dtype=np.int64) * slots_per_block
            if self.local_base is None
            else _as_i64(self.local_base, "local_base")
        )
        seq = np.zeros(n, np.int64) if self.sequence is None else _as_i64(self.sequence, "sequence")
        for name, a in (("slot_start", start), ("slot_end", end), ("local_base", base), ("sequence", seq)):
            if a.size != n:
                raise ValueError(f"{name} has {a.size} entries, block_ids has {n}")
        return GroupFill(blocks, start, end, base, seq)

    def select(self, keep: np.ndarray) -> "GroupFill":
        """The entries where ``keep`` is true (normalized entries only)."""
        return GroupFill(self.block_ids[keep], self.slot_start[keep], self.slot_end[keep], self.local_base[keep],
                         self.sequence[keep])

    def columns(self, with_sequence: bool = False) -> np.ndarray:
        """The entries as one int64 ``[n, 4]`` array (``[n, 5]`` with the sequence),
        the rows the kernels read (normalized entries only)."""
        cols = [self.block_ids, self.slot_start, self.slot_end, self.local_base]
        if with_sequence:
            cols.append(self.sequence)
        return np.stack(cols, axis=1)

    @property
    def num_entries(self) -> int:
        return len(self.block_ids)

    @property
    def num_slots(self) -> int:
        """Slots planned (normalized entries only)."""
        return int((np.asarray(self.slot_end) - np.asarray(self.slot_start)).sum())

    def validate(self, group: str, *, num_blocks: int, slots_per_block: int, num_sequences: int = 1) -> None:
        """Raise ValueError naming the group, the first bad entry and the bound
        (normalized entries only).  ``num_sequences``: the bank's sequences
        (1 without a bank: every sequence must then be 0)."""
        blocks, start, end, base = self.block_ids, self.slot_start, self.slot_end, self.local_base

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
            (start < 0) | (end > slots_per_block) | (start > end),
            "slot range outside the block",
            f"0 <= slot_start <= slot_end <= slots per block {slots_per_block}",
        )
        first_bad(base < 0, "negative local_base", "local_base >= 0")
        first_bad(base + end > np.iinfo(np.int32).max, "token index past 2**31", "local_base + slot_end < 2**31")
        bad_seq = (self.sequence < 0) | (self.sequence >= num_sequences)
        if bad_seq.any():
            i = int(np.flatnonzero(bad_seq)[0])
            raise ValueError(
                f"group {group!r} entry {i} (block {int(blocks[i])}): sequence {int(self.sequence[i])} is out of "
                f"range; expected 0 <= sequence < {num_sequences} (the bank's recorded sequences; 0 without a bank)"
            )
        self._check_one_writer(group, slots_per_block)

    def _check_one_writer(self, group: str, slots_per_block: int) -> None:
        """Entries that write a slot of the same block must agree on its
        value (local_base, sequence): repeated entries are fine, two writers
        of one slot with other values are not (on a GPU the result would be
        whichever landed last).  Entries sorted by (block, slot_start), each is
        compared with the earlier entry of its block reaching furthest: if it
        agrees, any other earlier writer of that slot disagrees with it too,
        and was caught before."""
        live = np.flatnonzero(self.slot_end > self.slot_start)
        if live.size < 2:
            return
        order = live[np.lexsort((self.slot_start[live], self.block_ids[live]))]
        b, e = self.block_ids[order], self.slot_end[order]
        n = order.size
        # Running maximum of (block, end), carrying the index of the entry that holds it.
        reach = np.maximum.accumulate(((b * (slots_per_block + 1) + e) * n) + np.arange(n))
        holder = order[reach[:-1] % n]
        later = order[1:]
        same_block = self.block_ids[holder] == self.block_ids[later]
        overlap = same_block & (self.slot_start[later] < self.slot_end[holder])
        clash = overlap & ((self.local_base[holder] != self.local_base[later])
                           | (self.sequence[holder] != self.sequence[later]))
        if clash.any():
            k = int(np.flatnonzero(clash)[0])
            i, j = sorted((int(holder[k]), int(later[k])))
            raise ValueError(
                f"group {group!r} entries {i} and {j} both write block {int(self.block_ids[i])} slot "
                f"{int(self.slot_start[later[k]])} with other values (local_base {int(self.local_base[i])} vs "
                f"{int(self.local_base[j])}, sequence {int(self.sequence[i])} vs {int(self.sequence[j])}); "
                f"expected entries that write one slot to agree on its token"
            )


@dataclass(frozen=True)
class FillPlan:
    """A step's fill: entries per registered group name."""

    groups: Mapping[str, GroupFill] = field(default_factory=dict)

    @staticmethod
    def of(plan: "FillPlan | Mapping[str, GroupFill]") -> "FillPlan":
        return plan if isinstance(plan, FillPlan) else FillPlan(dict(plan))

    def __getitem__(self, group: str) -> GroupFill:
        return self.groups[group]

    def __contains__(self, group: str) -> bool:
        return group in self.groups

    @property
    def num_entries(self) -> int:
        return sum(g.num_entries for g in self.groups.values())
