"""Where a replaying engine keeps its bank's rows (``FillEngine(bank_placement=...)``):
``device``, each layer's rows on the caches' device, read in place by every
fill; ``host``, in host memory, the rows each fill reads staged through
``staging_bytes`` on the device (``staging.py``; None: 256 MiB).  Past a
recorded sequence's end (``past_bank``): ``wrap`` replays it again from its
start as recorded; ``rotate`` re-rotates the keys of the layers ``rotary``
names (layer -> ``rotary.Rotary``) to their true positions (``rotary.py``),
staging the rows of entries that reach there.  Either way
the rows are checked against the caches first (layers, row sizes, dtypes),
and what goes on the device must fit there.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import torch

from kvfill.bank import Bank, BankError, free_bytes

from . import values as V
from .rotary import Rerotation, Rotary, table_nbytes
from .host_copy import is_host
from .staging import STAGING_BYTES, Staging, host_rows, size


PLACEMENTS = ("device", "host")
PAST_BANK = ("wrap", "rotate")


def check_placement(placement: str, staging_bytes: int | None, past_bank: str = "wrap",
                    rotary: Mapping[str, Rotary] | None = None) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"bank_placement {placement!r} is not one of {list(PLACEMENTS)}")
    if staging_bytes is not None and (isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int)
                                      or staging_bytes < 1):
        raise ValueError(f"staging_bytes must be an int >= 1 (or None: {STAGING_BYTES >> 20} MiB), got "
                         f"{staging_bytes!r}")
    if past_bank not in PAST_BANK:
        raise ValueError(f"past_bank {past_bank!r} is not one of {list(PAST_BANK)}")
    bad = [n for n, r in (rotary or {}).items() if not isinstance(r, Rotary)]
    if bad:
        raise ValueError(f"rotary[{bad[0]!r}] is a {type(rotary[bad[0]]).__name__}; expected a kernels.rotary.Rotary")
    if rotary and past_bank != "rotate":
        raise ValueError(f"rotary tables for {len(rotary)} layers with past_bank {past_bank!r}; they are read with "
                         f"past_bank 'rotate' only")


def placed_rows(registry, bank: Bank, placement: str, staging_bytes: int | None,
                rotary: Mapping[str, Rotary] | None = None) -> tuple[list, Staging | None,
                                                                     tuple[int, int]]:
    """Every replaying tensor of ``registry`` (a ``registry.Registry``, which
    calls this while it registers: read through its fields, not imported)
    given its layer's rows as the fill reads them
    (on the device, or staged there), after checking the bank matches the
    caches; the staging (None: every row read in place); and the device
    bytes counted for them: ``(held, transient)`` - held, the rows uploaded,
    the staging and the rotary tables, all the bank keeps on the device;
    transient, the most a fill's re-rotation takes beside them
    (``turn_bytes``).  The ledger of tests/test_device_ledger.py holds the
    engine to both."""
    formats = registry.row_formats()
    need = {}  # layer -> (its stored rows, the format that orders them for its caches, or None)
    vdtype = {}
    for t in registry.tensors:
        if t.mode == V.REPLAY and t.layer not in need:
            need[t.layer] = bank.check_rows(t.layer, t.tensor.dtype, formats[t.layer], t.row_vdtype)
            vdtype[t.layer] = t.row_vdtype
    device = registry.device
    unknown = sorted(set(rotary or {}) - set(need))
    if unknown:
        raise ValueError(f"rotary names layers no replayed group holds: {unknown[:4]}")
    counted = 0 if is_host(device) else table_nbytes(rotary or {})
    _check_room(bank, "the rotary tables", counted, device,
                "a smaller max_model_len, or past_bank 'wrap'")
    tables: dict = {}  # one device copy per distinct table, shared by every re-rotated layer
    rerotate = {n: Rerotation(r, formats[n].order, vdtype[n], device, tables) for n, r in (rotary or {}).items()}
    groups = {t.layer: t.group for t in registry.tensors if t.mode == V.REPLAY}
    staged_groups = set(groups.values()) if placement == "host" else {groups[n] for n in rerotate}
    staged = [n for n in need if groups[n] in staged_groups]
    capacity, asked = 0, STAGING_BYTES if staging_bytes is None else staging_bytes
    if staged:
        row_bytes = sum(need[n][0].shape[1] * need[n][0].element_size() for n in staged)
        capacity = max(max(registry.groups[g].slots_per_block for g in staged_groups),
                       asked // max(row_bytes, 1))
    transient = turn_bytes(rerotate, capacity) if not is_host(device) else 0
    if placement == "host":
        _check_room(bank, f"the {len(need)} replayed layers' staging", capacity * row_bytes + transient, device,
                    "a smaller staging_bytes")
        staging = Staging({n: (groups[n], host_rows(r, fmt.order if fmt is not None else None))
                           for n, (r, fmt) in need.items()}, bank.sequence_table(), device, capacity,
                          _dcps(registry), rerotate, asked)
        return _with(registry.tensors, staging), staging, (counted + capacity * row_bytes, transient)
    # What is uploaded (a host bank for GPU caches); rows already there are used in place.
    nbytes = sum(r.numel() * r.element_size() for r, _ in need.values() if r.device != device)
    nbytes += capacity * sum(need[n][0].shape[1] * need[n][0].element_size() for n in staged)
    _check_room(bank, f"the {len(need)} replayed layers' rows", nbytes + transient, device,
                "bank_placement 'host', lower gpu_memory_utilization, or record fewer sequences or positions")
    on_device = {}  # one layer at a time: a permuted copy lives only until its upload
    for name, (r, fmt) in need.items():
        rows = (fmt.to_cache(r) if fmt is not None else r).view(V.BITS_DTYPE[r.element_size()])
        if name in staged:  # the bank's rows, then the staging its re-rotated rows are gathered into
            out = torch.empty(rows.shape[0] + capacity, rows.shape[1], dtype=rows.dtype, device=device)
            out[:rows.shape[0]].copy_(rows)
            on_device[name] = out
        else:
            on_device[name] = rows.to(device).contiguous()
    counted += nbytes
    if not staged:
        return _with(registry.tensors, None, on_device), None, (counted, 0)
    staging = Staging({n: (groups[n], on_device[n]) for n in staged}, bank.sequence_table(), device, capacity,
                      _dcps(registry), rerotate, asked)
    return _with(registry.tensors, staging, on_device), staging, (counted, transient)


def turn_bytes(rerotate: Mapping[str, Rerotation], rows: int) -> int:
    """The device temporaries of re-rotating ``rows`` staged rows of every
    layer: one key's angles (shared), then the layers one at a time."""
    if not rerotate or not rows:
        return 0
    parts = [r.transient_bytes(rows) for r in rerotate.values()]
    return max(a for a, _ in parts) + max(t for _, t in parts)


def _dcps(registry) -> dict:
    return {name: g.dcp for name, g in registry.groups.items()}


def _with(tensors: list, staging: Staging | None, on_device: dict | None = None) -> list:
    rows = dict(on_device or {})
    if staging is not None:
        rows.update(staging.rows())
    host = staging.host if staging is not None else {}
    turn = staging.rerotate if staging is not None else {}
    return [replace(t, bank=rows[t.layer], host=host.get(t.layer), rerotate=turn.get(t.layer))
            if t.mode == V.REPLAY else t for t in tensors]


def _check_room(bank: Bank, what: str, nbytes: int, device, way_out: str) -> None:
    free = free_bytes(device) if nbytes else None
    if free is not None and nbytes > free:
        raise BankError(f"{bank.source}: {what} need {size(nbytes)} on {device}, {size(free)} are free "
                        f"(on a GPU: {way_out})")
