"""Test support: cache layouts the engine must address, built without vLLM.

Used by kvfill's tests, ``gpu/gpu_check_sections.py`` and ``gpu/ptx_check.py``
(on machines with torch and triton only); public, so they need no private names.

* ``standard_views``: vLLM's per-layer ``[B, H, N, C]`` views over one raw
  buffer in any of its six physical orders (the strides of vLLM's
  ``create_kv_cache_views``; the tests check that where vLLM is installed).
* ``CASES``: the layout zoo.  A ``Case`` builds its layer tensors as views of
  a ``uint8`` buffer, so a check can build the very same views over a copy
  (the expected buffer) and compare every byte of the backing memory.
* ``DTYPES``: (name, cache dtype, encoding) of every supported storage.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# vLLM's KVCacheLayout stride orders over the logical [L, B, H, N, C] dims.
STANDARD_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def standard_views(
    num_layers, num_blocks, heads, block_size, content, dtype, layout="LBNHC", device="cpu", raw=None
):
    """Per-layer ``[B, H, N, C]`` views of one buffer in the given physical order.

    Returns ``(raw_uint8_buffer, [view per layer])``.
    """
    shape = (num_layers, num_blocks, heads, block_size, content)
    strides = [0] * 5
    step = 1
    for dim in reversed(STANDARD_LAYOUTS[layout]):
        strides[dim] = step
        step *= shape[dim]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if raw is None:
        raw = torch.empty(step * itemsize, dtype=torch.uint8, device=device)
    typed = raw.view(dtype)
    view5 = typed.as_strided(shape, strides, 0)
    return raw, [view5[i] for i in range(num_layers)]


NUM_BLOCKS = 6
BLOCK_SIZE = 8
HEADS = 2
HEAD_DIM = 4
NUM_LAYERS = 2

# (name, cache dtype, encoding)
DTYPES = [
    ("fp32", torch.float32, "auto"),
    ("fp16", torch.float16, "auto"),
    ("bf16", torch.bfloat16, "auto"),
    ("fp8e4m3", torch.float8_e4m3fn, "auto"),
    ("fp8e5m2", torch.float8_e5m2, "auto"),
    ("u8-fp8e4m3", torch.uint8, "fp8_e4m3"),
    ("u8-fp8e5m2", torch.uint8, "fp8_e5m2"),
    ("fp8e4m3fnuz", torch.float8_e4m3fnuz, "auto"),
    ("u8-fp8e4m3fnuz", torch.uint8, "fp8_e4m3fnuz"),
    ("u8-packed", torch.uint8, "packed"),
]


@dataclass
class Case:
    name: str
    # (buffer, dtype) -> {layer name: tensor or list of state tensors}
    make: Callable[[torch.Tensor, torch.dtype], dict]
    nbytes: Callable[[int], int]  # itemsize -> buffer bytes
    block_dim: int = 0
    slot_dim: int | None = 2
    kernel_split: int = 1
    block_size: int = BLOCK_SIZE
    # (num_kv_heads, head_size, head_size_v) where the view does not name its
    # K/V heads itself ([B, H, N, 2 x head]: vLLM's per-layer view on the GPU);
    # a bank's canonical rows are permuted into it and cut per TP rank.
    kv: tuple[int, int, int] | None = None

    @property
    def state_list(self) -> bool:
        return self.slot_dim is None


def _standard(layout_name: str):
    def make(buf, dtype):
        _, views = standard_views(NUM_LAYERS, NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM, dtype, layout_name, raw=buf)
        return {f"layer.{i}": v for i, v in enumerate(views)}

    return make


def _kernel_split(ratio: int):
    # LBNHC with each manager block split into `ratio` dense kernel blocks:
    # the view has NUM_BLOCKS * ratio rows of BLOCK_SIZE // ratio slots.
    def make(buf, dtype):
        _, views = standard_views(
            NUM_LAYERS, NUM_BLOCKS * ratio, HEADS, BLOCK_SIZE // ratio, 2 * HEAD_DIM, dtype, "LBNHC", raw=buf
        )
        return {f"layer.{i}": v for i, v in enumerate(views)}

    return make


def _padded(pad_bytes: int):
    # LBNHC pages of HEADS * BLOCK_SIZE * C elements followed by padding.
    def make(buf, dtype):
        itemsize = torch.empty((), dtype=dtype).element_size()
        page = HEADS * BLOCK_SIZE * 2 * HEAD_DIM
        stride = page + pad_bytes // itemsize
        t = buf.view(dtype)
        return {
            f"layer.{i}": t.as_strided(
                (NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_DIM),
                (stride, 2 * HEAD_DIM, HEADS * 2 * HEAD_DIM, 1),
                i * NUM_BLOCKS * stride,
            )
            for i in range(NUM_LAYERS)
        }

    return make


def page_nbytes(itemsize: int) -> int:
    return HEADS * BLOCK_SIZE * 2 * HEAD_DIM * itemsize


def dense_nbytes(itemsize: int, pad: int = 0) -> int:
    return NUM_LAYERS * NUM_BLOCKS * (page_nbytes(itemsize) + pad)


def _typed(buf, dtype, offset_elems=0):
    return buf.view(dtype)[offset_elems:]


def _fa_old(buf, dtype):
    # FlashAttention (2, num_blocks, N, H, D): block dim 1.
    n = 2 * NUM_BLOCKS * BLOCK_SIZE * HEADS * HEAD_DIM
    t = _typed(buf, dtype)
    return {
        f"layer.{i}": t[i * n : (i + 1) * n].view(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
        for i in range(NUM_LAYERS)
    }


def _nhd(buf, dtype):
    n = 2 * NUM_BLOCKS * BLOCK_SIZE * HEADS * HEAD_DIM
    t = _typed(buf, dtype)
    return {
        f"layer.{i}": t[i * n : (i + 1) * n].view(NUM_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_DIM)
        for i in range(NUM_LAYERS)
    }


def _hnd(buf, dtype):
    # Stored (num_blocks, 2, H, N, D), seen as (num_blocks, 2, N, H, D).
    n = 2 * NUM_BLOCKS * BLOCK_SIZE * HEADS * HEAD_DIM
    t = _typed(buf, dtype)
    return {
        f"layer.{i}": t[i * n : (i + 1) * n]
        .view(NUM_BLOCKS, 2, HEADS, BLOCK_SIZE, HEAD_DIM)
        .permute(0, 1, 3, 2, 4)
        for i in range(NUM_LAYERS)
    }


MLA_DIM = 36


def _mla(buf, dtype):
    n = NUM_BLOCKS * BLOCK_SIZE * MLA_DIM
    # A storage offset of 3 elements: views need not start at their buffer.
    t = _typed(buf, dtype, 3)
    return {f"layer.{i}": t[i * n : (i + 1) * n].view(NUM_BLOCKS, BLOCK_SIZE, MLA_DIM) for i in range(NUM_LAYERS)}


CONV, SSM = (3, 5), (2, 4, 3)


def _mamba(buf, dtype):
    t = _typed(buf, dtype)
    nc, ns = NUM_BLOCKS * 15, NUM_BLOCKS * 24
    out, pos = {}, 0
    for i in range(NUM_LAYERS):
        conv = t[pos : pos + nc].view(NUM_BLOCKS, *CONV)
        ssm = t[pos + nc : pos + nc + ns].view(NUM_BLOCKS, *SSM)
        # The conv state is stored transposed, as some backends do.
        conv = conv.view(NUM_BLOCKS, CONV[1], CONV[0]).transpose(1, 2)
        out[f"layer.{i}"] = [conv, ssm]
        pos += nc + ns
    return out


KV = (HEADS, HEAD_DIM, HEAD_DIM)
CASES = [Case(f"std-{name}", _standard(name), dense_nbytes, kv=KV) for name in STANDARD_LAYOUTS] + [
    Case("fa-2xB", _fa_old, dense_nbytes, block_dim=1),
    Case("nhd-Bx2", _nhd, dense_nbytes),
    Case("hnd-Bx2", _hnd, dense_nbytes),
    Case("mla", _mla, lambda s: (NUM_LAYERS * NUM_BLOCKS * BLOCK_SIZE * MLA_DIM + 3) * s, slot_dim=1),
    Case("mamba-states", _mamba, lambda s: NUM_LAYERS * NUM_BLOCKS * 39 * s, slot_dim=None),
    Case("LBNHC-kernel-split2", _kernel_split(2), dense_nbytes, kernel_split=2, kv=KV),
    Case("LBNHC-padded", _padded(64), lambda s: dense_nbytes(s, 64), kv=KV),
]
CASE_IDS = [c.name for c in CASES]
