"""Independent reference for tests: what a fill must leave in a backing buffer.

Nothing here uses kvfill's layout or backend code.  Values come from the value
function's definition (scalar lowbias32, the encoded value table) and are
written with plain tensor indexing on a view built identically over a copy of
the buffer, so a layout bug in kvfill shows up as a byte mismatch.
"""
from __future__ import annotations

import torch

from kvfill.kernels import values as V


def poisoned_buffer(nbytes: int, seed: int = 1234) -> torch.Tensor:
    """Random bytes, on the tests' device (CPU unless KVFILL_TEST_DEVICE is set):
    torch's default device, as a factory sees it (tests/device_rule.py's too)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g, device="cpu")
    return buf.to(torch.empty(0).device)


def dcp_position(local: int, world: int, rank: int, interleave: int) -> int:
    return (local // interleave) * (interleave * world) + rank * interleave + local % interleave


def row_bits(
    *, mode, mean, std, seed, layer, position, row_size, vdtype, itemsize, elem_offset=0
) -> torch.Tensor:
    """The storage bits of one token row, from the value function's definition."""
    table = V.host_table(mode, float(mean), float(std), vdtype, itemsize)
    if mode == V.ZERO or vdtype is None:
        return torch.zeros(row_size, dtype=table.dtype, device=table.device)
    if mode == V.CONSTANT:
        return table[0].repeat(row_size)
    h = V.lowbias32(V.layer_key(seed, layer) + position) + elem_offset
    start = (h % V.POOL_SIZE) // V.ROW_ALIGN * V.ROW_ALIGN
    idx = torch.tensor([(start + e) % V.POOL_SIZE for e in range(row_size)], device=table.device)
    return table[idx]


def write_expected(
    view: torch.Tensor,
    *,
    block_dim: int,
    slot_dim: int | None,
    kernel_split: int,
    block: int,
    slot: int,
    bits: torch.Tensor,
) -> None:
    """Write one token row into ``view`` (a view of the expected buffer)."""
    bits_dtype = V.BITS_DTYPE[view.element_size()]
    v = view.view(bits_dtype)
    idx: list = [slice(None)] * v.dim()
    if slot_dim is None:
        idx[block_dim] = block
    else:
        kbs = v.shape[slot_dim]
        idx[block_dim] = block * kernel_split + slot // kbs
        idx[slot_dim] = slot % kbs
    target = v[tuple(idx)]
    target.copy_(bits.to(target.device).view(target.shape))
