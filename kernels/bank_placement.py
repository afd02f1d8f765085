"""Where a replaying engine keeps its bank's rows (``FillEngine(bank_placement=...)``):
``device``, each layer's rows on the caches' device, read in place by every
fill; ``host``, in host memory, the rows each fill reads staged through a
buffer on the device (``host_bank.StagedBank``).  Either way the rows are
checked against the caches first (layers, row sizes, dtypes), and what goes
on the device must fit there.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from kvfill.bank import Bank, BankError, free_bytes

from . import values as V
from .host_bank import STAGING_BYTES, StagedBank, host_rows, size

if TYPE_CHECKING:
    from .registry import LayerTensor, Registry

PLACEMENTS = ("device", "host")


def check_placement(placement: str, staging_bytes: int | None) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"bank_placement {placement!r} is not one of {list(PLACEMENTS)}")
    if staging_bytes is not None and (isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int)
                                      or staging_bytes < 1):
        raise ValueError(f"staging_bytes must be an int >= 1 (or None: {STAGING_BYTES >> 20} MiB), got "
                         f"{staging_bytes!r}")


def placed_rows(registry: "Registry", bank: Bank, placement: str,
                staging_bytes: int | None) -> tuple[list["LayerTensor"], StagedBank | None]:
    """Every replaying tensor given its layer's rows as the fill reads them
    (on the device, or the layer's device staging), after checking the bank
    matches the caches; and the staged bank (None: placement ``device``)."""
    formats = registry.row_formats()
    need = {}  # layer -> (its stored rows, the format that orders them for its caches, or None)
    for t in registry.tensors:
        if t.mode == V.REPLAY and t.layer not in need:
            need[t.layer] = bank.check_rows(t.layer, t.tensor.dtype, formats[t.layer], t.row_vdtype)
    device = registry.device
    if placement == "host":
        groups = {t.layer: t.group for t in registry.tensors if t.mode == V.REPLAY}
        min_rows = max(registry.groups[g].slots_per_block for g in set(groups.values()))
        staged = StagedBank({n: (groups[n], host_rows(r, fmt.order if fmt is not None else None))
                             for n, (r, fmt) in need.items()}, bank.sequence_table(), device,
                            STAGING_BYTES if staging_bytes is None else staging_bytes, min_rows)
        _check_room(bank, f"the {len(need)} replayed layers' staging", staged.nbytes, device,
                    "a smaller staging_bytes")
        tensors = _with(registry.tensors, staged.staging())
        return [replace(t, host=staged.host[t.layer]) if t.mode == V.REPLAY else t for t in tensors], staged
    # What is uploaded (a host bank for GPU caches); rows already there are used in place.
    nbytes = sum(r.numel() * r.element_size() for r, _ in need.values() if r.device != device)
    _check_room(bank, f"the {len(need)} replayed layers' rows", nbytes, device,
                "bank_placement 'host', lower gpu_memory_utilization, or record fewer sequences or positions")
    on_device = {}  # one layer at a time: a permuted copy lives only until its upload
    for name, (r, fmt) in need.items():
        rows = fmt.to_cache(r) if fmt is not None else r
        on_device[name] = rows.to(device).contiguous().view(V.BITS_DTYPE[r.element_size()])
    return _with(registry.tensors, on_device), None


def _with(tensors: list["LayerTensor"], rows: dict) -> list["LayerTensor"]:
    return [replace(t, bank=rows[t.layer]) if t.mode == V.REPLAY else t for t in tensors]


def _check_room(bank: Bank, what: str, nbytes: int, device, way_out: str) -> None:
    free = free_bytes(device) if nbytes else None
    if free is not None and nbytes > free:
        raise BankError(f"{bank.source}: {what} need {size(nbytes)} on {device}, {size(free)} are free "
                        f"(on a GPU: {way_out})")
