"""Triton scatter-fill kernel and its launch: the planned slots of many layers
of one geometry per launch.

Imported lazily: under ``TRITON_INTERPRET=1`` (CPU tests) the variable must be
set before the ``@triton.jit`` definition below runs.

Grid: ``(num_entries, num_layers_in_class)``.  Program (i, l) writes entry i's
slot range of one block of layer l: it reads the 16-byte plan entry (20 with a
replay sequence) and the layer's row of the layer table, then stores 2-D tiles
``[TILE_SLOTS slots, TILE_ELEMS elements]`` of raw storage bits.  No float math
runs here: values are gathered from a small table of pre-encoded bits
(``values.py``) or, replaying, from the layer's bank rows (``bank.py``), so
every backend stores the same bytes.  Layers are element offsets from one
typed reference pointer, aligned to ``LAYER_ALIGN``; how a launch class is
addressed and its launches issued is ``triton_backend.py``'s.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvfill.bank import DcpGeometry

from . import values as V
from .layout import Layout

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
MODE_CODE = {V.ZERO: 0, V.CONSTANT: 1, V.NORMAL: 2, V.REPLAY: 3}
# Elements stored per program per tile: enough in flight on a GPU; larger under
# the interpreter, whose cost is per tile, not per element.
TILE_NUMEL = 16384 if INTERPRETED else 4096
MAX_TILE_ELEMS = 1024  # widest tile along a token row
MAX_LAYERS_PER_LAUNCH = 65535  # layers are the grid's y dimension: CUDA's limit


@triton.jit
def _lowbias32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def scatter_fill_kernel(
    entries_ptr,     # *int32 [num_entries, ENTRY_COLS]: block, slot_start, slot_end, local_base[, sequence]
    layers_ptr,      # *int64 [num_layers, 3]: offset from ref_ptr (elements), row key (replay: bank
                     #   rows' offset from table_ptr, elements), element offset in the layer's row
    ref_ptr,         # *bits: the class's reference tensor
    table_ptr,       # *bits  [POOL_SIZE + ROW_ELEMS - 1] (normal), [1] (constant / zero), or
                     #   replay: the class's lowest-addressed bank rows [T, BANK_ROW]
    dcp_world_size,  # W of this group
    dcp_rank,        # r of this rank
    dcp_interleave,  # I of this group
    num_blocks,      # manager blocks; entries outside [0, num_blocks) write nothing
    seqs_ptr,        # *int64 [S, 2]: replay: each sequence's first bank row and length
    bank_sequences,  # replay: S (1 otherwise)
    MODE: tl.constexpr,                    # 0 zero, 1 constant, 2 normal, 3 replay
    ENTRY_COLS: tl.constexpr,              # 4, or 5 with a replay sequence per entry
    LAYER_ALIGN: tl.constexpr,             # every layer offset is a multiple of this (elements)
    BANK_ROW: tl.constexpr,                # replay: elements per bank row (the layer's row)
    BANK_ALIGN: tl.constexpr,              # replay: bank offsets, BANK_ROW and element offsets are multiples
    BLOCK_STRIDE: tl.constexpr,            # elements between manager blocks
    SLOTS_PER_BLOCK: tl.constexpr,         # token slots per manager block
    SLOTS_PER_KERNEL_BLOCK: tl.constexpr,  # token slots per kernel block (< SLOTS_PER_BLOCK: split blocks)
    KERNEL_BLOCK_STRIDE: tl.constexpr,     # elements between the kernel blocks of one manager block
    SLOT_STRIDE: tl.constexpr,             # elements between slots of a kernel block
    ELEM_SIZE0: tl.constexpr, ELEM_SIZE1: tl.constexpr, ELEM_SIZE2: tl.constexpr, ELEM_SIZE3: tl.constexpr,
    ELEM_STRIDE0: tl.constexpr, ELEM_STRIDE1: tl.constexpr, ELEM_STRIDE2: tl.constexpr,
    ELEM_STRIDE3: tl.constexpr,            # the token row's element dims (outermost first) and strides
    ROW_ELEMS: tl.constexpr,               # ELEM_SIZE0 * ... * ELEM_SIZE3 elements per token row
    POOL_MASK: tl.constexpr,
    ROW_ALIGN: tl.constexpr,               # row starts are multiples of this (table entries)
    TILE_SLOTS: tl.constexpr,              # slots per tile
    TILE_ELEMS: tl.constexpr,              # row elements per tile
):
    entry = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    # One plan entry; int64 before any multiplication by a stride.
    block = tl.load(entries_ptr + entry * ENTRY_COLS).to(tl.int64)
    # Host-built plans are validated before upload; device-built plans (CUDA
    # graph capture) are not, so bad entries are made empty here: never a
    # write outside the block.
    valid = (block >= 0) & (block < num_blocks)
    s_lo = tl.maximum(tl.load(entries_ptr + entry * ENTRY_COLS + 1), 0)
    s_hi = tl.where(valid, tl.minimum(tl.load(entries_ptr + entry * ENTRY_COLS + 2), SLOTS_PER_BLOCK), 0)
    local_base = tl.load(entries_ptr + entry * ENTRY_COLS + 3)
    layer_off = tl.multiple_of(tl.load(layers_ptr + layer * 3), LAYER_ALIGN)
    key_or_bank = tl.load(layers_ptr + layer * 3 + 1)  # int64: a row key, or replaying a bank offset
    elem_off64 = tl.load(layers_ptr + layer * 3 + 2)
    key = key_or_bank.to(tl.uint32)
    elem_off = elem_off64.to(tl.uint32)
    if MODE == 3:
        # This layer's bank rows, and the entry's sequence (clamped: device-built
        # plans are not validated on the host).
        bank_off = tl.multiple_of(key_or_bank + elem_off64, BANK_ALIGN)
        if ENTRY_COLS == 5:
            seq = tl.load(entries_ptr + entry * ENTRY_COLS + 4)
            seq = tl.minimum(tl.maximum(seq, 0), bank_sequences - 1).to(tl.int64)
        else:
            seq = tl.zeros([], dtype=tl.int64)
        seq_first = tl.load(seqs_ptr + seq * 2)
        seq_len = tl.load(seqs_ptr + seq * 2 + 1)
    bits_ty = ref_ptr.dtype.element_ty
    dst = ref_ptr + layer_off + block * BLOCK_STRIDE

    for e0 in range(0, ROW_ELEMS, TILE_ELEMS):
        # Element offsets of this column tile: the digits of e over the element dims.
        e = e0 + tl.arange(0, TILE_ELEMS)
        e_mask = e < ROW_ELEMS
        rest = e.to(tl.int64)
        e_addr = (rest % ELEM_SIZE3) * ELEM_STRIDE3
        rest = rest // ELEM_SIZE3
        e_addr += (rest % ELEM_SIZE2) * ELEM_STRIDE2
        rest = rest // ELEM_SIZE2
        e_addr += (rest % ELEM_SIZE1) * ELEM_STRIDE1
        e_addr += (rest // ELEM_SIZE1) * ELEM_STRIDE0
        for s0 in range(s_lo, s_hi, TILE_SLOTS):
            s = s0 + tl.arange(0, TILE_SLOTS)
            s_mask = s < s_hi
            # Slot -> (kernel block, slot in it) -> element offset from the block.
            s_addr = (s // SLOTS_PER_KERNEL_BLOCK).to(tl.int64) * KERNEL_BLOCK_STRIDE + (
                s % SLOTS_PER_KERNEL_BLOCK
            ).to(tl.int64) * SLOT_STRIDE
            ptrs = dst + s_addr[:, None] + e_addr[None, :]
            mask = s_mask[:, None] & e_mask[None, :]
            if MODE == 2:
                # Local slot -> global token position (DCP), one hash per row.
                local = local_base + s
                t = ((local // dcp_interleave) * (dcp_interleave * dcp_world_size)
                     + dcp_rank * dcp_interleave + local % dcp_interleave)
                # start(t) = ((hash + elem_off) mod POOL_SIZE) rounded down to a
                # multiple of ROW_ALIGN; the multiply shows Triton the alignment.
                h = (_lowbias32(key + t.to(tl.uint32)) + elem_off) & POOL_MASK
                start = (h // ROW_ALIGN).to(tl.int32) * ROW_ALIGN
                vals = tl.load(table_ptr + (start[:, None] + e[None, :]), mask=mask)
            elif MODE == 3:
                # Bank row (sequence, l mod N_s) of the rank-local slot l: the bank
                # holds this rank's positions in local order (kvfill/bank/parts.py; l = t
                # without DCP); contiguous along the row, so the loads vectorise.
                local = local_base + s
                # (l % N + N) % N: a device-built entry with a negative base still reads inside the bank
                row = seq_first + ((local % seq_len + seq_len) % seq_len).to(tl.int64)
                src = tl.multiple_of(bank_off + row * BANK_ROW, BANK_ALIGN)
                vals = tl.load(table_ptr + (src[:, None] + e[None, :]), mask=mask)
            elif MODE == 1:
                vals = tl.zeros([TILE_SLOTS, TILE_ELEMS], dtype=bits_ty) + tl.load(table_ptr)
            else:
                vals = tl.zeros([TILE_SLOTS, TILE_ELEMS], dtype=bits_ty)
            tl.store(ptrs, vals, mask=mask)


def tile_shape(layout: Layout) -> tuple[int, int]:
    """``(TILE_SLOTS, TILE_ELEMS)`` for a layout: whole rows up to MAX_TILE_ELEMS."""
    tile_elems = min(triton.next_power_of_2(max(layout.row_size, 1)), MAX_TILE_ELEMS)
    tile_slots = max(1, min(triton.next_power_of_2(layout.slots_per_block), TILE_NUMEL // tile_elems))
    return tile_slots, tile_elems


def kernel_constexprs(layout: Layout, mode: str, layer_align: int, entry_cols: int = 4, bank_row: int = 0,
                      bank_align: int = 1, pool_bits: int = V.POOL_BITS) -> dict[str, int]:
    """The compile-time arguments of ``scatter_fill_kernel`` for one launch class."""
    sizes, strides = layout.padded_elem_dims()
    tile_slots, tile_elems = tile_shape(layout)
    return dict(
        MODE=MODE_CODE[mode],
        ENTRY_COLS=entry_cols,
        LAYER_ALIGN=layer_align,
        BANK_ROW=bank_row,
        BANK_ALIGN=bank_align,
        BLOCK_STRIDE=layout.block_stride,
        SLOTS_PER_BLOCK=layout.slots_per_block,
        SLOTS_PER_KERNEL_BLOCK=layout.slots_per_kernel_block,
        KERNEL_BLOCK_STRIDE=layout.kernel_block_stride,
        SLOT_STRIDE=layout.slot_stride,
        **{f"ELEM_SIZE{i}": d for i, d in enumerate(sizes)},
        **{f"ELEM_STRIDE{i}": st for i, st in enumerate(strides)},
        ROW_ELEMS=layout.row_size,
        POOL_MASK=(1 << pool_bits) - 1,
        ROW_ALIGN=V.ROW_ALIGN,
        TILE_SLOTS=tile_slots,
        TILE_ELEMS=tile_elems,
    )


def launch_fill(
    entries: torch.Tensor,
    layer_table: torch.Tensor,
    ref: torch.Tensor,
    layer_align: int,
    table: torch.Tensor,
    layout: Layout,
    mode: str,
    dcp: DcpGeometry,
    bank_row: int = 0,
    bank_align: int = 1,
    sequences: torch.Tensor | None = None,
    pool_bits: int = V.POOL_BITS,
) -> None:
    """One launch: every entry of ``entries`` x every layer row of ``layer_table``.

    ``entries``: int32 ``[n, 4]`` or ``[n, 5]`` (with sequences) on the device;
    ``layer_table``: int64 ``[L, 3]`` on the device (element offset from
    ``ref``, row key or bank offset, element offset in the row); ``ref``: the
    reference tensor viewed as its bits dtype; ``layer_align``: a power of two
    dividing every offset; ``table``: the value bits (value_tables.value_table) or,
    replaying, the reference bank rows, same dtype as ``ref``;
    ``bank_row``: elements per bank row; ``bank_align``: a power of two
    dividing every bank offset and the row; ``sequences``: replaying, the
    bank's int64 ``[S, 2]`` (first row, length) on the device; ``pool_bits``:
    the value table's size, ``2**pool_bits`` (a packed row part's may be larger).
    """
    n, num_layers = entries.shape[0], layer_table.shape[0]
    if n == 0 or num_layers == 0:
        return
    num_sequences = sequences.shape[0] if sequences is not None else 1
    if sequences is None:  # never read outside replay; the kernel still takes a pointer
        sequences = layer_table
    scatter_fill_kernel[(n, num_layers)](
        entries, layer_table, ref, table,
        dcp.world_size, dcp.rank, dcp.interleave, layout.num_blocks, sequences, num_sequences,
        **kernel_constexprs(layout, mode, layer_align, entries.shape[1], bank_row, bank_align, pool_bits),
    )
