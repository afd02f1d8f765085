"""Test layouts: kvfill.kernels.testing's cases plus the same geometries built by
vLLM itself (``create_kv_cache_views``): the six standard orders, kernel-block
splitting and padded pages."""
from __future__ import annotations

import torch
from kvfill.kernels.testing import (  # noqa: F401  (re-exported for the tests)
    BLOCK_SIZE,
    CASES as BUILT_CASES,
    DTYPES,
    HEAD_DIM,
    HEADS,
    NUM_BLOCKS,
    NUM_LAYERS,
    STANDARD_LAYOUTS,
    Case,
    dense_nbytes,
)


def _spec(dtype, **kw):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=dtype, **kw)


def vllm_views(layout_name: str, *, kernel_block_size=None, pad=0):
    """Views exactly as vLLM builds them."""

    def make(buf, dtype):
        from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views
        from vllm.v1.kv_cache_layout import KVCacheLayout

        layout = KVCacheLayout[layout_name]
        probe = _spec(dtype)
        spec = _spec(dtype, page_size_padded=probe.page_size_bytes + pad) if pad else probe
        names = [f"layer.{i}" for i in range(NUM_LAYERS)]
        layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, NUM_LAYERS, layout)
        kvt = KVCacheTensor(size=buf.numel(), layers=names, layer_stride=layer_stride, block_stride=block_stride)
        views = create_kv_cache_views(
            buf.view(torch.int8), spec, NUM_BLOCKS, layout, kvt, kernel_block_size=kernel_block_size
        )
        return dict(zip(names, views))

    return make


try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except ImportError:  # e.g. the GPU machine: torch and triton only
    HAVE_VLLM = False

if HAVE_VLLM:
    VLLM_CASES = [Case(f"vllm-{name}", vllm_views(name), dense_nbytes) for name in STANDARD_LAYOUTS] + [
        Case("vllm-LBNHC-kernel-split2", vllm_views("LBNHC", kernel_block_size=BLOCK_SIZE // 2), dense_nbytes,
             kernel_split=2),
        Case("vllm-LBNHC-padded", vllm_views("LBNHC", pad=64), lambda s: dense_nbytes(s, 64)),
    ]
    CASES = VLLM_CASES + [c for c in BUILT_CASES if not c.name.startswith("std-")]
else:  # the same geometries, built without vLLM (checked equal where vLLM exists)
    VLLM_CASES = []
    CASES = list(BUILT_CASES)
CASE_IDS = [c.name for c in CASES]
