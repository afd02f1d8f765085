"""Triton scatter-fill: the planned slots of many layers of one geometry per launch.

Imported lazily: under ``TRITON_INTERPRET=1`` (CPU tests) the variable must be
set before the ``@triton.jit`` definition below runs.

Grid: ``(num_entries, num_layers_in_class)``.  Program (i, l) writes entry i's
slot range of one block of layer l: it reads the 16-byte plan entry and the
layer's row of the layer table, then stores 2-D tiles ``[TILE_S slots, TILE_E
elements]`` of raw storage bits.  No float math runs here: values are gathered
from a small table of pre-encoded bits (``values.py``), so every backend stores
the same bytes.

Layers are addressed as element offsets from one typed reference pointer (the
class's lowest-addressed tensor) rather than as raw integer addresses: Triton
knows the reference's alignment from its argument specialisation, and
``LAYER_ALIGN`` (checked on the host) tells it the offsets' alignment, so the
stores along a contiguous row can be vectorised.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import values as V
from .layout import Layout

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
MODE_CODE = {V.ZERO: 0, V.CONSTANT: 1, V.NORMAL: 2}
# Elements stored per tile: enough in flight per program on a GPU; larger under
# the interpreter, whose cost is per tile, not per element.
TILE_ELEMS = 16384 if INTERPRETED else 4096
MAX_TILE_E = 1024


@triton.jit
def _lowbias32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _scatter_fill_kernel(
    entries_ptr,   # *int32 [num_entries, 4]: block, slot_start, slot_end, local_base
    layers_ptr,    # *int64 [num_layers, 3]: offset from ref_ptr (elements), row key, element offset
    ref_ptr,       # *bits: the class's reference tensor
    table_ptr,     # *bits  [POOL_SIZE + ROW - 1] (normal) or [1] (constant / zero)
    dcp_world,     # W of this group
    dcp_rank,      # r of this rank
    interleave,    # I of this group
    num_blocks,    # manager blocks; entries outside [0, num_blocks) write nothing
    MODE: tl.constexpr,          # 0 zero, 1 constant, 2 normal
    LAYER_ALIGN: tl.constexpr,   # every layer offset is a multiple of this (elements)
    BLOCK_STRIDE: tl.constexpr,  # elements between manager blocks
    BLOCK_SIZE: tl.constexpr,    # slots per manager block
    KBS: tl.constexpr,           # slots per kernel block
    KSTRIDE: tl.constexpr,       # elements between kernel blocks of one manager block
    SSTRIDE: tl.constexpr,       # elements between slots
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
    ROW: tl.constexpr,           # D0 * D1 * D2 * D3 elements per token row
    POOL_MASK: tl.constexpr,
    ROW_ALIGN: tl.constexpr,     # row starts are multiples of this (table entries)
    TILE_S: tl.constexpr,
    TILE_E: tl.constexpr,
):
    entry = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    # One plan entry; int64 before any multiplication by a stride.
    block = tl.load(entries_ptr + entry * 4).to(tl.int64)
    # Host-built plans are validated before upload; device-built plans (CUDA
    # graph capture) are not, so bad entries are made empty here: never a
    # write outside the block.
    valid = (block >= 0) & (block < num_blocks)
    s_lo = tl.maximum(tl.load(entries_ptr + entry * 4 + 1), 0)
    s_hi = tl.where(valid, tl.minimum(tl.load(entries_ptr + entry * 4 + 2), BLOCK_SIZE), 0)
    local_base = tl.load(entries_ptr + entry * 4 + 3)
    layer_off = tl.multiple_of(tl.load(layers_ptr + layer * 3), LAYER_ALIGN)
    key = tl.load(layers_ptr + layer * 3 + 1).to(tl.uint32)
    elem_off = tl.load(layers_ptr + layer * 3 + 2).to(tl.uint32)
    bits_ty = ref_ptr.dtype.element_ty
    dst = ref_ptr + layer_off + block * BLOCK_STRIDE

    for e0 in range(0, ROW, TILE_E):
        # Element offsets of this column tile, digits of e over (D0, D1, D2, D3).
        e = e0 + tl.arange(0, TILE_E)
        e_mask = e < ROW
        rest = e.to(tl.int64)
        e_addr = (rest % D3) * S3
        rest = rest // D3
        e_addr += (rest % D2) * S2
        rest = rest // D2
        e_addr += (rest % D1) * S1
        e_addr += (rest // D1) * S0
        for s0 in range(s_lo, s_hi, TILE_S):
            s = s0 + tl.arange(0, TILE_S)
            s_mask = s < s_hi
            s_addr = (s // KBS).to(tl.int64) * KSTRIDE + (s % KBS).to(tl.int64) * SSTRIDE
            ptrs = dst + s_addr[:, None] + e_addr[None, :]
            mask = s_mask[:, None] & e_mask[None, :]
            if MODE == 2:
                # Local slot -> global token position (DCP), one hash per row.
                local = local_base + s
                t = (local // interleave) * (interleave * dcp_world) + dcp_rank * interleave + local % interleave
                # start(t) = ((hash + elem_off) mod POOL_SIZE) rounded down to a
                # multiple of ROW_ALIGN; the multiply shows Triton the alignment.
                h = (_lowbias32(key + t.to(tl.uint32)) + elem_off) & POOL_MASK
                start = (h // ROW_ALIGN).to(tl.int32) * ROW_ALIGN
                vals = tl.load(table_ptr + (start[:, None] + e[None, :]), mask=mask)
            elif MODE == 1:
                vals = tl.zeros([TILE_S, TILE_E], dtype=bits_ty) + tl.load(table_ptr)
            else:
                vals = tl.zeros([TILE_S, TILE_E], dtype=bits_ty)
            tl.store(ptrs, vals, mask=mask)


def tile_shape(layout: Layout) -> tuple[int, int]:
    tile_e = min(triton.next_power_of_2(max(layout.row_size, 1)), MAX_TILE_E)
    tile_s = max(1, min(triton.next_power_of_2(layout.block_size), TILE_ELEMS // tile_e))
    return tile_s, tile_e


def launch_fill(
    entries: torch.Tensor,
    layer_table: torch.Tensor,
    ref: torch.Tensor,
    layer_align: int,
    table: torch.Tensor,
    layout: Layout,
    mode: str,
    dcp: tuple[int, int, int],
) -> None:
    """One launch: every entry of ``entries`` x every layer row of ``layer_table``.

    ``entries``: int32 ``[n, 4]`` on the device; ``layer_table``: int64
    ``[L, 3]`` on the device (element offset from ``ref``, row key, element
    offset in the row); ``ref``: the reference tensor viewed as its bits dtype;
    ``layer_align``: a power of two dividing every offset; ``table``: the value
    bits (values.value_table), same dtype as ``ref``; ``dcp``: (W, r, I).
    """
    n, num_layers = entries.shape[0], layer_table.shape[0]
    if n == 0 or num_layers == 0:
        return
    (d0, d1, d2, d3), (s0, s1, s2, s3) = layout.padded_elem_dims()
    tile_s, tile_e = tile_shape(layout)
    world, rank, interleave = dcp
    _scatter_fill_kernel[(n, num_layers)](
        entries, layer_table, ref, table,
        world, rank, interleave, layout.num_blocks,
        MODE=MODE_CODE[mode],
        LAYER_ALIGN=layer_align,
        BLOCK_STRIDE=layout.block_stride,
        BLOCK_SIZE=layout.block_size,
        KBS=layout.kernel_block_size,
        KSTRIDE=layout.kernel_block_stride,
        SSTRIDE=layout.slot_stride,
        D0=d0, D1=d1, D2=d2, D3=d3,
        S0=s0, S1=s1, S2=s2, S3=s3,
        ROW=layout.row_size,
        POOL_MASK=V.POOL_MASK,
        ROW_ALIGN=V.ROW_ALIGN,
        TILE_S=tile_s,
        TILE_E=tile_e,
    )
