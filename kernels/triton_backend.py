"""Triton backend: one launch per launch class with planned entries, so the
launch count depends on neither the number of layers nor the number of
requests.  At registration it addresses each class's layers as element
offsets from one typed reference pointer (the class's lowest-addressed
tensor) rather than as raw integer addresses - Triton knows the reference's
alignment from its argument specialisation, and ``LAYER_ALIGN`` (checked here)
tells it the offsets' alignment, so the stores along a contiguous row can be
vectorised - and builds the layer table; per fill it uploads the plan once
and calls ``triton_fill.launch_fill`` per class (through the module, so a
test can replace it).  Imported lazily, like ``triton_fill``: under
``TRITON_INTERPRET=1`` the variable must be set before the kernel is defined.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from . import triton_fill
from . import values as V
from .backend import FillBackend
from .host_copy import upload
from .plan import GroupFill
from .registry import LaunchClass, Registry

ENTRY_ALIGN_BYTES = 16  # Triton's pointer specialisation: aligned to 16 bytes or not


@dataclass(frozen=True)
class _ClassLaunch:
    """How one launch class is addressed: its rows of the layer table, the
    reference tensor the layer offsets count from, their alignment, and what
    the values are read from (a value table, or the reference bank rows)."""

    cls: LaunchClass
    layer_rows: slice
    ref: torch.Tensor
    layer_align: int
    table: torch.Tensor
    bank_row: int = 0
    bank_align: int = 1


def _addressing(tensors: list[torch.Tensor], names: list[str], itemsize: int) -> tuple[torch.Tensor, int, list[int]]:
    """(reference tensor as bits, offset alignment, element offset of each tensor)
    for tensors of one element size addressed from the lowest-addressed one."""
    ref_i = min(range(len(tensors)), key=lambda i: tensors[i].data_ptr())
    offsets = []
    for t, name in zip(tensors, names):
        delta = t.data_ptr() - tensors[ref_i].data_ptr()
        if delta % itemsize:
            raise ValueError(
                f"{name} starts {delta} bytes after {names[ref_i]}, not a "
                f"multiple of its {itemsize}-byte elements; cannot address both in one launch"
            )
        offsets.append(delta // itemsize)
    return tensors[ref_i].view(V.BITS_DTYPE[itemsize]), pow2_dividing(offsets, 16 // itemsize), offsets


def pow2_dividing(values: list[int], limit: int) -> int:
    """Largest power of two <= ``limit`` dividing every value."""
    align = limit
    while align > 1 and any(v % align for v in values):
        align //= 2
    return align


class TritonBackend(FillBackend):
    """One launch per launch class with planned entries: the launch count
    depends on neither the number of layers nor the number of requests."""

    name = "triton"

    def __init__(self, registry: Registry):
        super().__init__(registry)
        rows: list[tuple[int, int, int]] = []
        self._launches: list[_ClassLaunch] = []
        for c in registry.classes:
            if len(c.tensors) > triton_fill.MAX_LAYERS_PER_LAUNCH:
                raise ValueError(
                    f"group {c.group!r}: {len(c.tensors)} layer tensors of one geometry exceed the "
                    f"{triton_fill.MAX_LAYERS_PER_LAUNCH} one launch can address (the grid's y dimension)"
                )
            itemsize = c.layout.itemsize
            ref, align, offsets = _addressing([t.tensor for t in c.tensors],
                                              [f"layer {t.layer!r}" for t in c.tensors], itemsize)
            cl_rows = slice(len(rows), len(rows) + len(offsets))
            if c.mode == V.REPLAY:
                # Column 1 holds each layer's bank rows as an offset from the lowest-addressed ones.
                bank, bank_align, bank_offsets = _addressing(
                    [t.bank for t in c.tensors], [f"the bank rows of layer {t.layer!r}" for t in c.tensors], itemsize)
                bank_align = pow2_dividing([bank_align, c.bank_row, *(t.elem_offset for t in c.tensors)],
                                           16 // itemsize)
                self._launches.append(_ClassLaunch(c, cl_rows, ref, align, bank, c.bank_row, bank_align))
                rows.extend((o, b, t.elem_offset) for o, b, t in zip(offsets, bank_offsets, c.tensors))
            else:
                self._launches.append(_ClassLaunch(c, cl_rows, ref, align, c.table))
                rows.extend((o, t.key, t.elem_offset) for o, t in zip(offsets, c.tensors))
        # Per layer tensor: (element offset from its class's reference, row key
        # or bank offset, element offset in the row).
        self.layer_table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).to(registry.device)
        self.entry_cols = 5 if any(c.mode == V.REPLAY for c in registry.classes) else 4

    def _launch(self, cl: _ClassLaunch, entries: torch.Tensor, sequences: torch.Tensor | None = None) -> None:
        c = cl.cls
        if sequences is None:
            sequences = self.registry.bank_sequences
        triton_fill.launch_fill(entries, self.layer_table[cl.layer_rows], cl.ref, cl.layer_align, cl.table, c.layout,
                                c.mode, self.registry.groups[c.group].dcp, cl.bank_row, cl.bank_align,
                                sequences if c.mode == V.REPLAY else None, V.pool_bits(c.part))

    def fill(self, plan: Mapping[str, GroupFill], sequences: np.ndarray | None = None) -> int:
        # One upload of the whole plan: int32 [n, 4] ([n, 5] with replay
        # sequences), pinned when the target is a GPU; a staged fill's
        # sequences (int64 [S, 2]) in the same upload, after the entries.
        # Each group's rows start 16-byte aligned (replay entries are 20 bytes):
        # Triton specialises a pointer on its 16-byte alignment, so a slice off
        # it would compile another variant than warmup's, at the first fill or
        # under capture.  Padding rows are never launched.
        step = ENTRY_ALIGN_BYTES // math.gcd(ENTRY_ALIGN_BYTES, 4 * self.entry_cols)
        parts, rows, pos = [], {}, 0
        for g in plan:
            cols = plan[g].columns(self.entry_cols == 5).astype(np.int32)
            pad = -len(cols) % step
            parts += [cols, np.zeros((pad, self.entry_cols), dtype=np.int32)]
            rows[g] = slice(pos, pos + len(cols))
            pos += len(cols) + pad
        flat = [p.reshape(-1) for p in parts]
        if sequences is not None:  # after the entries, whose groups' rows end 16-byte aligned
            flat.append(np.ascontiguousarray(sequences, dtype=np.int64).reshape(-1).view(np.int32))
        uploaded = upload(torch.from_numpy(np.concatenate(flat)), self.registry.device)  # pinned, non-blocking
        n = pos * self.entry_cols
        entries = uploaded[:n].view(pos, self.entry_cols)
        table = uploaded[n:].view(torch.int64).view(-1, 2) if sequences is not None else None
        launches = 0
        for cl in self._launches:
            if cl.cls.group in rows:
                self._launch(cl, entries[rows[cl.cls.group]], table)
                launches += 1
        return launches

    def warmup(self, num_positions: int = 0) -> int:
        """Launch every class once with one empty entry (slots [0, 0)); a
        replaying engine also with a 4-column entry (device-built plans
        without sequences), so neither variant compiles under graph capture."""
        launches = 0
        for cols in sorted({self.entry_cols, 4}):
            empty = torch.zeros(1, cols, dtype=torch.int32, device=self.registry.device)
            for cl in self._launches:
                self._launch(cl, empty)
                launches += 1
        return launches

    def fill_device_entries(self, group: str, entries: torch.Tensor) -> int:
        self.registry.group(group)
        if entries.dtype != torch.int32 or entries.dim() != 2 or entries.shape[1] not in (4, 5):
            raise ValueError(f"entries must be int32 [n, 4] or [n, 5] (with replay sequences), got "
                             f"{entries.dtype} {tuple(entries.shape)}")
        if not entries.is_contiguous():  # the kernel reads entry i at offset ENTRY_COLS * i
            raise ValueError(f"entries must be contiguous, got strides {entries.stride()}")
        if entries.device != self.registry.device:
            raise ValueError(f"entries are on {entries.device}, the caches on {self.registry.device}")
        staged = self.registry.staged
        if staged is not None and group in staged.groups:
            if any(staged.group_of[n] == group for n in staged.host):
                raise ValueError(f"group {group!r} replays a bank kept in host memory (bank_placement 'host'), "
                                 f"whose rows each fill stages from its host plan; device-built entries (CUDA "
                                 f"graphs) need bank_placement 'device'")
            raise ValueError(f"group {group!r} re-rotates keys past each recorded sequence's end (past_bank "
                             f"'rotate'), staged from each fill's host plan; device-built entries (CUDA graphs) "
                             f"need past_bank 'wrap'")
        launches = 0
        for cl in self._launches:
            if cl.cls.group == group:
                self._launch(cl, entries)
                launches += 1
        return launches
