"""Verify: recompute what every planned slot must hold and compare bits.

Independent of the backend that wrote the caches: expected rows come from the
value function or the bank (``slot_rows.expected_rows``), actual rows are read back
through each tensor's layout.  Synchronises with the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from . import values as V
from .plan import GroupFill
from .registry import Registry
from .slot_rows import SlotRows, expected_rows, read_rows, value_source


@dataclass(frozen=True)
class Mismatch:
    layer: str
    sub: int | None
    block: int
    slot: int
    element: int
    expected: float
    found: float


@dataclass(frozen=True)
class VerifyReport:
    ok: bool
    num_checked: int
    num_mismatched: int
    first: tuple[Mismatch, ...]

    def __bool__(self) -> bool:
        return self.ok


def verify_plan(registry: Registry, plan: Mapping[str, GroupFill], *, max_report: int = 8) -> VerifyReport:
    """``plan``: normalized, validated entries per registered group."""
    checked = mismatched = 0
    first: list[Mismatch] = []
    rows = {g: SlotRows(entries, registry.groups[g].dcp) for g, entries in plan.items()}
    for c in registry.classes:
        r = rows.get(c.group)
        if r is None:
            continue
        for t in c.tensors:
            got = read_rows(t.tensor, c.layout, r)
            want = expected_rows(r, c.layout, *value_source(c, t, r)).to(got.device).expand_as(got)
            bad = got != want
            checked += got.numel()
            mismatched += int(bad.sum())
            for ri, e in bad.nonzero()[: max(0, max_report - len(first))].tolist():
                first.append(Mismatch(
                    layer=t.layer, sub=t.sub, block=int(r.block[ri]), slot=int(r.slot[ri]), element=e,
                    expected=_decode(want[ri, e], c.vdtype), found=_decode(got[ri, e], c.vdtype),
                ))
    return VerifyReport(mismatched == 0, checked, mismatched, tuple(first))


def read_plan(registry: Registry, plan: Mapping[str, GroupFill],
              layers: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """What the planned slots hold, per layer: ``[num_rows, layer row]`` in the
    caches' dtype, rows in plan order (entry by entry, slots ascending),
    elements in the layout-independent order (a layer's tensors one after
    another).  Zero-mode tensors (packed, recurrent state) are left out;
    ``layers``: only these (None: every layer)."""
    rows = {g: SlotRows(entries, registry.groups[g].dcp) for g, entries in plan.items()}
    wanted = None if layers is None else set(layers)
    parts: dict[str, list[torch.Tensor]] = {}
    for t in registry.tensors:  # registration order: a layer's tensors in row order
        r = rows.get(t.group)
        if r is not None and t.mode != V.ZERO and (wanted is None or t.layer in wanted):
            parts.setdefault(t.layer, []).append(read_rows(t.tensor, t.layout, r).view(t.tensor.dtype))
    return {layer: torch.cat(ps, dim=1) for layer, ps in parts.items()}


def _decode(bits: torch.Tensor, vdtype: torch.dtype | None) -> float:
    if vdtype is None or bits.element_size() != torch.empty((), dtype=vdtype, device="cpu").element_size():
        return float(bits.item())  # raw: zero-filled, or a byte of a wider value (a packed row's part)
    try:
        return float(bits.reshape(1).view(vdtype).float().item())
    except (NotImplementedError, RuntimeError):  # e2m1 pairs: torch does not decode them
        return float(bits.item())
