"""vLLM CPU's attention cache: where a token's K and V really are.

vLLM's CPU attention backend (``CPU_ATTN``) allocates each layer's cache as
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``, but that shape is
not how its kernels use the bytes: they view a (block, head) page as
``[2 * block_size, head_size]``, keep V as ``[block_size, head_size]`` in the
second half, and - for the ``vec`` / ``vec16`` ISAs, measured on vLLM 0.32 -
store K transposed, ``[head_size, block_size]``, in the first half.  Row
``s`` of the registered shape therefore holds pieces of other tokens, and a
fill of "slots [0, n)" would write other tokens' K and V.

``cpu_kv_parts`` gives the two views that do address token ``s``: K
``[B, H, N, D]`` with strides ``(page, 2ND, 1, N)`` and V with strides
``(page, 2ND, D, 1)`` from offset ``N * D``, registered as ``RowParts`` so a
layer's row is ``[K heads x D, V heads x D]`` - the order of GPU caches'
``(2, ..., H, D)`` rows, so a bank recorded on CPU has GPU-order rows.
``layout_matches`` checks the views against vLLM's own write kernel on a
scratch cache (once per ISA, dtype and shape): an ISA that packs K another
way (AMX) is detected instead of assumed.
"""
from __future__ import annotations

import functools

import torch

from kvfill.kernels import RowParts


def cpu_kv_parts(cache: torch.Tensor, head_size: int) -> RowParts | None:
    """K and V views of a CPU attention cache (module docstring); None for a
    tensor that is not ``[B, H, N, 2 * head_size]`` with contiguous pages."""
    if cache.dim() != 4 or cache.shape[3] != 2 * head_size:
        return None
    blocks, heads, slots, _ = cache.shape
    d = head_size
    if cache.stride(3) != 1 or cache.stride(2) != 2 * d or (heads > 1 and cache.stride(1) != 2 * slots * d):
        return None
    page, head = cache.stride(0), 2 * slots * d
    off = cache.storage_offset()
    k = cache.as_strided((blocks, heads, slots, d), (page, head, 1, slots), off)
    v = cache.as_strided((blocks, heads, slots, d), (page, head, d, 1), off + slots * d)
    return RowParts((k, v))


def cpu_ops():
    """The module of vLLM's CPU attention ops: ``vllm._cpu_ops`` from vLLM
    0.34 (its CPU backend's), ``vllm._custom_ops`` before."""
    try:
        from vllm import _cpu_ops as ops
    except ImportError:
        from vllm import _custom_ops as ops
    return ops


@functools.lru_cache(maxsize=32)
def layout_matches(isa: str, dtype: torch.dtype, heads: int, slots: int, head_size: int) -> bool:
    """Whether vLLM's ``cpu_attn_reshape_and_cache`` (this ISA) writes tokens
    where ``cpu_kv_parts`` reads them: two tokens written to a scratch cache,
    read back through the views."""
    ops = cpu_ops()

    scratch = torch.zeros(2, heads, slots, 2 * head_size, dtype=dtype)
    key_cache, value_cache = scratch.view(2, heads, 2 * slots, head_size).chunk(2, dim=2)
    g = torch.Generator(device="cpu").manual_seed(0)
    key = torch.randn(2, heads, head_size, generator=g, device="cpu").to(dtype)
    value = torch.randn(2, heads, head_size, generator=g, device="cpu").to(dtype)
    where = [1, slots - 1]  # block 1: its second and last slot
    try:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                       torch.tensor([slots + s for s in where], dtype=torch.int64), isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    except (RuntimeError, AttributeError):
        # RuntimeError: a shape vLLM's CPU attention does not run (e.g. a test's
        # tiny heads); AttributeError: a vLLM build without its CPU ops.
        return False
    k, v = cpu_kv_parts(scratch, head_size)
    return all(torch.equal(k[1, :, s], key[i]) and torch.equal(v[1, :, s], value[i]) for i, s in enumerate(where))


def attention_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str) -> str | None:
    """The ISA vLLM's CPU attention picks for these caches (None if unknown)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return None
    try:
        return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
    except (NotImplementedError, TypeError):
        return None


def cpu_attention_parts(cache, spec, cache_dtype: str):
    """``(tensors to register, ok)``: a vLLM CPU attention cache as its K and
    V views when vLLM's own write kernel confirms them (ok), else the cache
    as registered - ok is False where an attention cache was not confirmed."""
    head_size = getattr(spec, "head_size", None)
    if not isinstance(cache, torch.Tensor) or head_size is None or cache.dim() != 4:
        return cache, True
    parts = cpu_kv_parts(cache, head_size)
    isa = attention_isa(cache.dtype, cache.shape[2], head_size, cache_dtype)
    if (parts is not None and isa is not None and cache_dtype == "auto"
            and layout_matches(isa, cache.dtype, cache.shape[1], cache.shape[2], head_size)):
        return parts, True
    return cache, False
