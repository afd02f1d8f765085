"""Torch ports of vLLM 0.32's writers of DeepSeek's sparse-attention caches:
the independent reference the packed-row tests (tests/test_packed_rows.py,
tests/test_dsa_connector.py) and bench/indexer_scores.py compare kvfill
with.  Nothing here uses kvfill's code.

* ``write_indexer``: ``_fp8_quant_and_cache_write``
  (``vllm/models/deepseek_v32/common/kernels.py``): per token the key's
  absolute maximum, the scale ``2^ceil(log2(max(amax, 1e-4) / 448))``, fp8
  e4m3 keys ``k / scale`` at byte ``offset * D`` of the token's kernel-block
  page and the float32 scale at byte ``P * D + 4 * offset``.
* ``pack_ds_mla``: the fused writer's ``fp8_ds_mla`` row (656 B): 4 tiles of
  128 fp8 values, each tile's power-of-two scale as float32, 64 bf16 RoPE
  values.
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quant_indexer(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 keys ``[T, D]`` -> (fp8 ``[T, D]``, float32 scales ``[T]``)."""
    k = k.float()
    scale = torch.exp2(torch.ceil(torch.log2(k.abs().amax(-1).clamp_min(1e-4) / FP8_MAX)))
    return (k / scale[:, None]).to(FP8), scale


def pages(cache: torch.Tensor) -> torch.Tensor:
    """A ``[kernel blocks, (1,) P, W]`` uint8 cache as ``[kernel blocks, P * W]`` pages (its page stride)."""
    blocks, tokens, width = cache.shape[0], cache.shape[-2], cache.shape[-1]
    return cache.as_strided((blocks, tokens * width), (cache.stride(0), 1), cache.storage_offset())


def write_indexer(cache: torch.Tensor, k: torch.Tensor, kernel_slots) -> None:
    """Token i's key ``k[i]`` into kernel slot ``kernel_slots[i]`` (kernel
    block ``slot // P``, offset ``slot % P``), as vLLM's writer lays it out."""
    tokens, width = cache.shape[-2], cache.shape[-1]
    dim = width - 4
    page = pages(cache)
    q, scale = quant_indexer(k)
    slots = torch.as_tensor(list(kernel_slots), dtype=torch.int64, device=cache.device)
    block, offset = (slots // tokens)[:, None], (slots % tokens)[:, None]
    arange = lambda n: torch.arange(n, device=cache.device)  # noqa: E731
    page[block, offset * dim + arange(dim)] = q.view(torch.uint8)
    page[block, tokens * dim + offset * 4 + arange(4)] = scale.contiguous().view(torch.uint8).view(-1, 4)


def indexer_row(k: torch.Tensor) -> torch.Tensor:
    """What kvfill's canonical indexer row of each token holds: its D fp8 key bytes, then its scale's 4 bytes."""
    q, scale = quant_indexer(k)
    return torch.cat([q.view(torch.uint8), scale[:, None].contiguous().view(torch.uint8)], dim=1)


def pack_ds_mla(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """``[T, 512]`` latent and ``[T, 64]`` RoPE part -> ``[T, 656]`` uint8 rows."""
    t = kv_c.shape[0]
    tiles = kv_c.float().view(t, 4, 128)
    scale = torch.exp2(torch.ceil(torch.log2((tiles.abs().amax(-1) / FP8_MAX).clamp_min(1e-4))))
    out = torch.empty(t, 656, dtype=torch.uint8, device=kv_c.device)
    out[:, :512] = (tiles / scale[..., None]).to(FP8).view(t, 512).view(torch.uint8)
    out[:, 512:528] = scale.contiguous().view(torch.uint8).view(t, 16)
    out[:, 528:] = k_pe.to(torch.bfloat16).contiguous().view(torch.uint8).view(t, 128)
    return out


def unpack_ds_mla(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[T, 656]`` rows -> (decoded latent ``[T, 512]`` float32, scales ``[T, 4]``, RoPE ``[T, 64]`` bf16)."""
    rows = rows.contiguous()
    scale = rows[:, 512:528].contiguous().view(torch.float32)
    values = rows[:, :512].contiguous().view(FP8).float().view(-1, 4, 128) * scale[..., None]
    return values.view(-1, 512), scale, rows[:, 528:].contiguous().view(torch.bfloat16)
