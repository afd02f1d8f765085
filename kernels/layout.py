"""Addressing (block, slot-in-block, element) inside a registered cache tensor.

A layout is derived from the tensor itself - ``shape``, ``stride()``,
``storage_offset()``, ``data_ptr()`` and dtype - never from a table of assumed
shapes.  One dim is the block dim, at most one other the slot dim (tokens of a
block); every other dim is an *element* dim.  The element index ``e`` of a
token's row is the row-major index over the element dims in logical order, so
every physical order of the same logical view holds the same values.

All offsets are in elements of the tensor's dtype:

    offset(block b, slot s, element e) =
        b * block_stride
      + (s // slots_per_kernel_block) * kernel_block_stride
      + (s %  slots_per_kernel_block) * slot_stride
      + sum_i e_i * elem_strides[i]          (e_i: digits of e over elem_shape)

``slots_per_kernel_block < slots_per_block`` describes kernel-block-granular views, where
the block dim has ``num_blocks * r`` entries and manager block ``b`` is kernel
blocks ``[b*r, (b+1)*r)``.  Tensors without a slot dim (Mamba state rows) have
``slots_per_block == 1``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import values as V

MAX_ELEM_DIMS = 4


@dataclass(frozen=True)
class Layout:
    """Geometry of one cache tensor; hashable, so equal geometries share a launch."""

    itemsize: int
    num_blocks: int            # manager blocks
    slots_per_block: int       # slots (token rows) per manager block; 1 without a slot dim
    block_stride: int
    slots_per_kernel_block: int
    kernel_block_stride: int
    slot_stride: int
    elem_shape: tuple[int, ...]    # coalesced, logical order, no size-1 dims
    elem_strides: tuple[int, ...]

    @property
    def row_size(self) -> int:
        """Elements per token row."""
        return math.prod(self.elem_shape)

    @property
    def kernel_split(self) -> int:
        return self.slots_per_block // self.slots_per_kernel_block

    @property
    def canonical_shape(self) -> tuple[int, ...]:
        """``[num_blocks, r, slots_per_kernel_block, *elem_shape]``."""
        return (self.num_blocks, self.kernel_split, self.slots_per_kernel_block, *self.elem_shape)

    @property
    def canonical_strides(self) -> tuple[int, ...]:
        return (
            self.block_stride,
            self.kernel_block_stride,
            self.slot_stride,
            *self.elem_strides,
        )

    def padded_elem_dims(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Element dims left-padded with (1, 0) to MAX_ELEM_DIMS, for the kernel."""
        pad = MAX_ELEM_DIMS - len(self.elem_shape)
        return (1,) * pad + self.elem_shape, (0,) * pad + self.elem_strides


def _describe(t: torch.Tensor) -> str:
    return (
        f"shape {tuple(t.shape)}, strides {tuple(t.stride())}, "
        f"storage offset {t.storage_offset()}, dtype {t.dtype}"
    )


def _check_no_overlap(t: torch.Tensor) -> None:
    """Refuse tensors where two indices share an address (sufficient test)."""
    dims = sorted(
        (st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1
    )
    extent = 0  # largest offset reachable with the dims seen so far
    for st, sz in dims:
        if st <= extent:
            raise ValueError(
                f"cannot address a cache tensor with overlapping strides ({_describe(t)}): "
                "every element must have its own address"
            )
        extent += (sz - 1) * st


def _coalesce(shape: list[int], strides: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    out_shape: list[int] = []
    out_strides: list[int] = []
    for sz, st in zip(shape, strides):
        if sz == 1:
            continue
        if out_shape and out_strides[-1] == st * sz:
            out_shape[-1] *= sz
            out_strides[-1] = st
        else:
            out_shape.append(sz)
            out_strides.append(st)
    return tuple(out_shape), tuple(out_strides)


def default_slot_dim(ndim: int, block_dim: int) -> int | None:
    """The slot dim of vLLM's cache shapes when none is given.

    ``[B, H, N, C]``, ``(2, B, N, H, D)``, ``(B, 2, N, H, D)``: dim 2;
    MLA ``(B, N, D)``: dim 1; 1-D/2-D tensors (state rows): none.
    """
    if ndim >= 4:
        return 2 if block_dim != 2 else 1
    if ndim == 3:
        return 1 if block_dim != 1 else 2
    return None


def layout_of(
    t: torch.Tensor,
    *,
    block_dim: int = 0,
    slot_dim: int | None | str = "auto",
    num_blocks: int | None = None,
) -> Layout:
    """Derive the layout of ``t`` with ``block_dim`` indexing blocks.

    ``num_blocks``: the manager's block count; when ``t.shape[block_dim]`` is a
    multiple ``r`` of it, ``t`` is kernel-block granular (slot dim required).
    Raises ValueError naming shape, strides and dtype when ``t`` can't be addressed.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor cache, got {type(t).__name__}")
    nd = t.dim()
    if nd == 0:
        raise ValueError(f"cannot address a 0-d cache tensor ({_describe(t)})")
    if not -nd <= block_dim < nd:
        raise ValueError(f"block_dim {block_dim} is out of range for a {nd}-d cache ({_describe(t)})")
    block_dim %= nd
    if slot_dim == "auto":
        slot_dim = default_slot_dim(nd, block_dim)
    if slot_dim is not None:
        if not -nd <= slot_dim < nd or slot_dim % nd == block_dim:
            raise ValueError(
                f"slot_dim {slot_dim} must be a dim other than block_dim {block_dim} "
                f"of the cache ({_describe(t)})"
            )
        slot_dim %= nd
    if t.element_size() not in V.BITS_DTYPE or t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f"unsupported cache dtype ({_describe(t)})")
    _check_no_overlap(t)

    shape, strides = list(t.shape), list(t.stride())
    n_kernel_blocks = shape[block_dim]
    if num_blocks is None:
        num_blocks = n_kernel_blocks
    if num_blocks < 0 or (num_blocks == 0 and n_kernel_blocks != 0) or (
        num_blocks and n_kernel_blocks % num_blocks
    ):
        raise ValueError(
            f"cache has {n_kernel_blocks} entries along block_dim {block_dim}, which is not "
            f"a multiple of num_blocks={num_blocks} ({_describe(t)})"
        )
    ratio = n_kernel_blocks // num_blocks if num_blocks else 1
    kstride = strides[block_dim]
    if slot_dim is None:
        if ratio != 1:
            raise ValueError(
                f"a cache without a slot dim cannot be kernel-block granular "
                f"({n_kernel_blocks} rows for {num_blocks} blocks; {_describe(t)})"
            )
        kbs, slot_stride = 1, 0
    else:
        kbs, slot_stride = shape[slot_dim], strides[slot_dim]
    elem = [d for d in range(nd) if d not in (block_dim, slot_dim)]
    elem_shape, elem_strides = _coalesce([shape[d] for d in elem], [strides[d] for d in elem])
    if len(elem_shape) > MAX_ELEM_DIMS:
        raise ValueError(
            f"cache element dims coalesce to {len(elem_shape)} dims, more than "
            f"{MAX_ELEM_DIMS} ({_describe(t)})"
        )
    return Layout(
        itemsize=t.element_size(),
        num_blocks=num_blocks,
        slots_per_block=kbs * ratio,
        block_stride=kstride * ratio,
        slots_per_kernel_block=kbs,
        kernel_block_stride=kstride,
        slot_stride=slot_stride,
        elem_shape=elem_shape,
        elem_strides=elem_strides,
    )


def canonical_view(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``t`` seen as raw bits ``[num_blocks, r, slots_per_kernel_block, *elem_shape]``."""
    bits = t.view(V.BITS_DTYPE[layout.itemsize]) if t.dim() else t
    return bits.as_strided(layout.canonical_shape, layout.canonical_strides, t.storage_offset())
