"""The value tables a fill draws from, on the caches' device
(``value_table``), from the value function's host tables (``values.py``),
and those of a packed row's parts (``values.PartValues``, ``part_host_table``):
a part whose bytes encode values their own way - fp8 divided by a scale, a
float's bytes in a uint8 tensor, e2m1 (fp4) pairs - read as the normal
mode's table.
"""
from __future__ import annotations

import numpy as np
import torch

from . import values as V

# e2m1 (fp4) magnitudes, codes 0-7; code | 8 is the negative.  Two values per
# byte in float4_e2m1fn_x2, the even element in the low nibble (NVIDIA's nvfp4).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def encode_e2m1_pairs(values: np.ndarray) -> torch.Tensor:
    """float64 values (an even count) -> uint8 bytes of e2m1 pairs: each value
    rounded to the nearest e2m1 magnitude (ties to the even code), clamped
    to 6, its sign kept; value 2i in the low nibble of byte i."""
    v = np.asarray(values, dtype=np.float64)
    mags = np.array(E2M1)
    a = np.minimum(np.abs(v), mags[-1])
    dist = np.abs(a[:, None] - mags[None, :])
    best = dist.min(axis=1, keepdims=True)
    ties = dist == best
    codes = np.where(ties.sum(axis=1) > 1, np.argmax(ties & (np.arange(8) % 2 == 0), axis=1), np.argmin(dist, axis=1))
    codes = codes | np.where((v < 0) & (codes > 0), 8, 0)
    pairs = codes.reshape(-1, 2).astype(np.uint8)
    return torch.from_numpy((pairs[:, 0] | (pairs[:, 1] << 4)).astype(np.uint8))


def part_host_table(mode: str, mean: float, std: float, part: V.PartValues, itemsize: int) -> torch.Tensor:
    """The storage bits a part of a packed row draws from, read as the normal
    mode's table (``table[start(t) + e]``) whatever the fill's mode: a
    ``2**part.pool_bits``-entry table of the part's values (``part.constant``, else
    the fill's ``mean + std * z``, divided by ``part.scale``) as storage
    elements; a value wider than the storage takes ``storage_ratio``
    consecutive entries, and since every row start is a multiple of
    ``V.ROW_ALIGN`` element ``e`` of a row reads byte ``e % ratio`` of a
    value.  ``mode``: the fill's (zero: one zero entry)."""
    if mode == V.ZERO:
        return torch.zeros(1, dtype=V.BITS_DTYPE[itemsize], device="cpu")
    width = torch.empty((), dtype=part.vdtype, device="cpu").element_size()
    ratio = width // itemsize
    if ratio < 1 or width % itemsize or V.ROW_ALIGN % ratio:
        raise ValueError(f"a part of {part.vdtype} values cannot be stored in {itemsize}-byte elements")
    fp4 = part.vdtype == torch.float4_e2m1fn_x2  # two values a byte
    n = (1 << part.pool_bits) // ratio * (2 if fp4 else 1)
    if part.constant is not None or std == 0.0:
        values = np.full(n, part.constant if part.constant is not None else mean)
    else:  # fp4: a pool twice the table's entries, one value each (no pair repeats)
        values = mean + std * V.standard_normal_pool(part.pool_bits + (1 if fp4 else 0))[:n]
    if part.vdtype == torch.float4_e2m1fn_x2:
        return encode_e2m1_pairs(values / part.scale)
    bits = V.encode(values / part.scale, part.vdtype)
    return bits.view(V.BITS_DTYPE[itemsize])


_DEVICE_TABLES: dict = {}


def value_table(
    mode: str,
    mean: float,
    std: float,
    vdtype: torch.dtype | None,
    itemsize: int,
    device: torch.device,
    max_row: int = 1,
    part: V.PartValues | None = None,
) -> torch.Tensor:
    """Storage bits a fill draws from (``part``: a part of a packed row, whose
    table is read as the normal mode's whatever the mode: ``part_host_table``).

    normal: the pool followed by its first ``max_row - 1`` entries again, so a
    row of up to ``max_row`` elements reads ``table[start : start + row]``
    without wrapping; constant / zero: one entry.  Cached per device; the table
    is the only device memory a fill needs besides its plan, and its size does
    not depend on the fill.
    """
    if mode == V.ZERO or vdtype is None:
        mode, mean, std, vdtype, part = V.ZERO, 0.0, 0.0, None, None
    if mode != V.NORMAL and part is None:
        max_row = 1
    key = (mode, float(mean), float(std), vdtype, itemsize, torch.device(device), max_row, part)
    table = _DEVICE_TABLES.get(key)
    if table is None:
        if part is not None:
            table = part_host_table(mode, float(mean), float(std), part, itemsize)
        else:
            table = V.host_table(mode, float(mean), float(std), vdtype, itemsize)
        if (mode == V.NORMAL or part is not None) and max_row > 1:
            pool = 1 << V.pool_bits(part)
            reps = -(-(pool + max_row - 1) // pool)
            table = table.repeat(reps)[: pool + max_row - 1]
        table = table.to(device)
        _DEVICE_TABLES[key] = table
    return table
