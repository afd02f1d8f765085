"""Token rows packed of parts that each encode values their own way: the
caches of DeepSeek's sparse attention as vLLM's writers lay them out, seen as
``RowParts`` views the engine fills, records and replays like any row.

* **Indexer K cache** (DeepSeek-V3.2 / GLM-5: vLLM's ``DeepseekV32IndexerCache``,
  written by ``_fp8_quant_and_cache_write``): vLLM registers a byte container
  ``[kernel blocks, (1,) P, D + 4]`` uint8 (P = 64 tokens, D = 128), but a
  page is *not* token-major: its first ``P * D`` bytes are the P tokens' fp8
  e4m3 keys one after another, then P float32 scales (token t's at byte
  ``P * D + 4 t``).  ``indexer_parts`` returns the two views a token's row
  is made of: its D value bytes and its 4 scale bytes - so a fill of some
  tokens of a page writes exactly those tokens' bytes, and a bank row is a
  token's values and scale.
* **fp8_ds_mla** latent rows (656 B, token-major): 512 fp8 e4m3 values (4
  tiles of 128), 4 float32 scales (one per tile), 64 bf16 RoPE values.
  ``ds_mla_parts`` returns the three views.
* **nvfp4_ds_mla** rows (352 B, token-major): 512 e2m1 values two a byte
  (the even one in the low nibble), 64 e4m3 RoPE values, 32 e4m3 scales (one
  per 16 values, stored permuted - all equal in a synthetic fill, so the
  permutation does not matter).  ``nvfp4_ds_mla_parts`` returns the three
  views; ``nvfp4_ds_mla_values`` fp4 values ``v / s`` with ``s`` vLLM's
  rule for such values (``e4m3(max(amax / 6, 2^-9))``).

Both readers decode ``fp8 value * scale``, with the scale a power of two
(vLLM's writers: ``2^ceil(log2(max(amax, 1e-4) / 448))``).  A synthetic fill
(``indexer_values`` / ``ds_mla_values``) therefore stores ``v / s`` in fp8
and ``s`` as the scale, one power of two chosen as vLLM's writer would for
keys of the fill's spread: the rows decode to the fill's values (to fp8's
precision), their scores spread as keys do - not the all-ties of zeros.
Replay moves the recorded bytes whatever they encode.  vLLM 0.34 on a GPU
whose MQA-logits kernels take only MX-scaled keys (SM100:
``vllm.utils.deep_gemm.mqa_logits_use_mx_scales``) stores the indexer's
scale ``2^k`` not as float32 but as four equal UE8M0 bytes ``k + 127``
(``indexer_values(..., mx_scales=True)``, ``ue8m0_x4``).  A bank names
which its rows hold (``INDEXER_SCALES``); ``convert_indexer_scales``
turns recorded rows from one into the other where that is lossless (a
power of two either way).
"""
from __future__ import annotations

import math
import struct

import torch

from . import values as V
from .registry import RowParts

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value: what vLLM's writers scale keys to
SCALE_BYTES = 4  # a float32 scale
DS_MLA_TILES, DS_MLA_TILE = 4, 128
DS_MLA_ROPE = 64  # bf16 values
DS_MLA_ROW = DS_MLA_TILES * DS_MLA_TILE + DS_MLA_TILES * SCALE_BYTES + DS_MLA_ROPE * 2  # 656 B
NVFP4_DS_MLA_ROW = 512 // 2 + DS_MLA_ROPE + 512 // 16  # 352 B


def _pages(cache: torch.Tensor, what: str) -> tuple[int, int, int, int]:
    """(kernel blocks, tokens per page, bytes per token, page stride) of a
    vLLM cache ``[blocks, (1,) P, W]`` of uint8 whose pages are contiguous."""
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8:
        raise ValueError(f"{what}: expected a uint8 cache tensor, got "
                         f"{getattr(cache, 'dtype', type(cache).__name__)}")
    shape = list(cache.shape)
    if cache.dim() == 4 and shape[1] == 1:
        shape, strides = [shape[0], shape[2], shape[3]], [cache.stride(0), cache.stride(2), cache.stride(3)]
    elif cache.dim() == 3:
        strides = list(cache.stride())
    else:
        raise ValueError(f"{what}: expected a cache of shape [blocks, (1,) tokens, bytes], got {tuple(cache.shape)}")
    blocks, tokens, width = shape
    if strides[2] != 1 or strides[1] != width or (blocks > 1 and strides[0] < tokens * width):
        raise ValueError(f"{what}: expected pages of {tokens} x {width} contiguous bytes, got shape "
                         f"{tuple(cache.shape)} strides {tuple(cache.stride())}")
    return blocks, tokens, width, strides[0]


def _view(cache: torch.Tensor, blocks: int, tokens: int, width: int, stride: int, token_stride: int,
          offset: int) -> torch.Tensor:
    return cache.as_strided((blocks, tokens, width), (stride, token_stride, 1), cache.storage_offset() + offset)


def indexer_parts(cache: torch.Tensor) -> RowParts:
    """The indexer page's token rows: ``RowParts`` of its values view
    ``[blocks, P, D]`` (token t at ``t * D``) and its scales' bytes
    ``[blocks, P, 4]`` (token t at ``P * D + 4 t``), sharing ``cache``'s
    memory.  A ValueError names a cache of another shape or stride."""
    blocks, tokens, width, stride = _pages(cache, "indexer cache")
    dim = width - SCALE_BYTES
    if dim < 1:
        raise ValueError(f"indexer cache: {width} bytes per token leave no room for {SCALE_BYTES} scale bytes")
    return RowParts((_view(cache, blocks, tokens, dim, stride, dim, 0),
                     _view(cache, blocks, tokens, SCALE_BYTES, stride, SCALE_BYTES, tokens * dim)))


def ds_mla_parts(cache: torch.Tensor) -> RowParts:
    """An ``fp8_ds_mla`` cache's token rows: ``RowParts`` of its fp8 values
    ``[blocks, P, 512]``, its 4 scales' bytes ``[blocks, P, 16]`` and its
    RoPE part's bytes ``[blocks, P, 128]``, sharing ``cache``'s memory."""
    blocks, tokens, width, stride = _pages(cache, "fp8_ds_mla cache")
    if width != DS_MLA_ROW:
        raise ValueError(f"fp8_ds_mla cache: expected {DS_MLA_ROW} bytes per token (512 fp8 values, 4 float32 "
                         f"scales, 64 bf16 RoPE values), got {width}")
    nope, scales = DS_MLA_TILES * DS_MLA_TILE, DS_MLA_TILES * SCALE_BYTES
    return RowParts((_view(cache, blocks, tokens, nope, stride, width, 0),
                     _view(cache, blocks, tokens, scales, stride, width, nope),
                     _view(cache, blocks, tokens, DS_MLA_ROPE * 2, stride, width, nope + scales)))


def nvfp4_ds_mla_parts(cache: torch.Tensor) -> RowParts:
    """An ``nvfp4_ds_mla`` cache's token rows: ``RowParts`` of its fp4 values'
    bytes ``[blocks, P, 256]``, its RoPE part ``[blocks, P, 64]`` and its
    scales ``[blocks, P, 32]``, sharing ``cache``'s memory."""
    blocks, tokens, width, stride = _pages(cache, "nvfp4_ds_mla cache")
    if width != NVFP4_DS_MLA_ROW:
        raise ValueError(f"nvfp4_ds_mla cache: expected {NVFP4_DS_MLA_ROW} bytes per token (512 e2m1 values, 64 e4m3 "
                         f"RoPE values, 32 e4m3 scales), got {width}")
    return RowParts((_view(cache, blocks, tokens, 256, stride, width, 0),
                     _view(cache, blocks, tokens, DS_MLA_ROPE, stride, width, 256),
                     _view(cache, blocks, tokens, 32, stride, width, 256 + DS_MLA_ROPE)))


def part_dtypes(parts) -> tuple[torch.dtype | None, ...] | None:
    """The dtype each part of a recorded packed row encodes, known from the
    parts' element dims (what a bank records of a layer: ``Bank.parts``),
    None for a part that cannot hold NaN or inf (e2m1); None where the parts
    are none of the rows above.  An indexer's scale reads as float32 either
    way it is stored: four equal UE8M0 bytes make a finite float32 unless
    the byte is 255, UE8M0's NaN."""
    dims = tuple(tuple(int(d) for d in p) for p in parts or ())
    if len(dims) == 2 and len(dims[0]) == 1 and dims[1] == (SCALE_BYTES,):
        return torch.float8_e4m3fn, torch.float32
    if dims == ((DS_MLA_TILES * DS_MLA_TILE,), (DS_MLA_TILES * SCALE_BYTES,), (DS_MLA_ROPE * 2,)):
        return torch.float8_e4m3fn, torch.float32, torch.bfloat16
    if dims == ((256,), (DS_MLA_ROPE,), (32,)):
        return None, torch.float8_e4m3fn, torch.float8_e4m3fn
    return None


def power_of_two_scale(mean: float, std: float) -> float:
    """The scale vLLM's writers pick for keys of ``mean + std * z`` (their
    absolute maximum taken as ``|mean| + 4 std``): ``2^ceil(log2(max(amax,
    1e-4) / 448))``."""
    amax = max(abs(mean) + 4.0 * std, 1e-4)
    return math.ldexp(1.0, math.ceil(math.log2(amax / FP8_MAX)))


def ue8m0_x4(scale: float) -> float:
    """The float32 whose 4 bytes are the power of two ``scale`` as four
    equal UE8M0 bytes (its exponent ``k + 127``): the bytes vLLM 0.34's MX
    indexer writers store for it (``pack_ue8m0_x4``).  Finite for every
    exponent byte but 255 (then no power of two)."""
    m, e = math.frexp(scale)
    if m != 0.5 or not 1 <= e + 126 <= 254:
        raise ValueError(f"an MX scale is a normal float32 power of two, got {scale!r}")
    return struct.unpack("<f", bytes([e + 126] * 4))[0]


# How an indexer row stores its scale 2^k (a bank's provenance ``indexer_scales``): a float32, or
# four equal UE8M0 bytes k + 127 (vLLM 0.34 on SM100: ``pack_ue8m0_x4``, bits 23..30 of the float32).
SCALES_FLOAT32, SCALES_UE8M0_X4 = "float32", "ue8m0_x4"
INDEXER_SCALES = (SCALES_FLOAT32, SCALES_UE8M0_X4)
_UE8M0_SMALLEST_BITS = 0x00400000  # 2^-127: UE8M0's byte 0, a float32 subnormal
_CHUNK_ROWS = 1 << 20  # bounded temporaries


def _ue8m0_codes(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 scales' bytes ``[n, 4]`` -> (UE8M0 byte ``[n]``, whether it
    is exact): vLLM's ``pack_ue8m0_x4`` keeps bits 23..30 (the exponent), so
    it is the scale only for a positive power of two 2^-127 ... 2^127."""
    bits = scales.contiguous().view(torch.int32)[:, 0]
    exponent = (bits >> 23) & 0xFF
    power = (bits & ~(0xFF << 23)) == 0  # sign and mantissa clear
    exact = (power & (exponent >= 1) & (exponent <= 254)) | (bits == _UE8M0_SMALLEST_BITS)
    return exponent.to(torch.uint8), exact


def _float32_codes(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """UE8M0 scales' bytes ``[n, 4]`` -> (float32 bits ``[n]`` as int32,
    whether they are four equal bytes of a power of two: 255 is UE8M0's NaN)."""
    code = scales[:, 0].to(torch.int32)
    exact = (scales == scales[:, :1]).all(dim=1) & (code != 255)
    return torch.where(code == 0, torch.full_like(code, _UE8M0_SMALLEST_BITS), code << 23), exact


def _scale_text(scale: torch.Tensor, source: str) -> str:
    """One recorded scale's 4 bytes and what they read as under ``source``."""
    raw = bytes(int(b) for b in scale)
    if source == SCALES_FLOAT32:
        return f"{struct.unpack('<f', raw)[0]!r} (float32 bytes {raw.hex(' ')})"
    return f"UE8M0 bytes {raw.hex(' ')}"


def convert_indexer_scales(rows: torch.Tensor, source: str, target: str) -> int:
    """Indexer rows ``[T, D + 4]`` uint8 (D fp8 key bytes, then the scale's
    4 bytes: a bank's canonical indexer row) with every scale rewritten in
    place from ``source``'s encoding into ``target``'s (``INDEXER_SCALES``);
    the key bytes and the power of two are kept, so each row decodes to the
    same key.  Float32 2^k -> four bytes k + 127 (exactly vLLM 0.34's
    ``pack_ue8m0_x4``); four bytes b -> float32 2^(b - 127).  Nothing is
    written unless every row converts: a ValueError names the rows whose
    scale has no exact code in ``target`` (a float32 that is not a power of
    two or is below 2^-127; UE8M0 bytes that differ or are 255).  Returns
    the rows converted (0 when the encodings are the same)."""
    for enc in (source, target):
        if enc not in INDEXER_SCALES:
            raise ValueError(f"indexer scale encoding {enc!r} is not one of {list(INDEXER_SCALES)}")
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] <= SCALE_BYTES:
        raise ValueError(f"indexer rows must be [rows, key bytes + {SCALE_BYTES}] uint8, got "
                         f"{tuple(rows.shape)} {rows.dtype}")
    if source == target:
        return 0
    at = rows.shape[1] - SCALE_BYTES
    code = _ue8m0_codes if target == SCALES_UE8M0_X4 else _float32_codes
    bad, first = 0, None
    for a in range(0, rows.shape[0], _CHUNK_ROWS):  # every row checked before any is written
        _, exact = code(rows[a:a + _CHUNK_ROWS, at:])
        wrong = (~exact).nonzero()
        bad += len(wrong)
        if first is None and len(wrong):
            first = a + int(wrong[0, 0])
    if bad:
        why = ("a positive power of two from 2^-127 to 2^127 is one UE8M0 byte" if target == SCALES_UE8M0_X4
               else "a UE8M0 scale is four equal bytes below 255")
        raise ValueError(f"{bad} of {rows.shape[0]} indexer scales have no exact {target} code (first: row {first}, "
                         f"{_scale_text(rows[first, at:], source)}): {why}")
    for a in range(0, rows.shape[0], _CHUNK_ROWS):
        scales = rows[a:a + _CHUNK_ROWS, at:]
        new, _ = code(scales)
        if target == SCALES_UE8M0_X4:
            scales.copy_(new[:, None].expand(-1, SCALE_BYTES))
        else:
            scales.copy_(new[:, None].view(torch.uint8))
    return rows.shape[0]


def indexer_values(spec: V.ValueSpec, mx_scales: bool = False) -> tuple[V.PartValues, V.PartValues]:
    """The parts' encodings of a synthetic indexer row (``indexer_parts``):
    fp8 keys ``v / s`` and the scale ``s`` (``power_of_two_scale``), as
    float32 or, ``mx_scales``, as four UE8M0 bytes (``ue8m0_x4``)."""
    s = power_of_two_scale(spec.mean, spec.std)
    # keys a top-k scores: a larger table, so few positions share a key (values.PARTS_POOL_BITS)
    return (V.PartValues(torch.float8_e4m3fn, scale=s, pool_bits=V.PARTS_POOL_BITS),
            V.PartValues(torch.float32, constant=ue8m0_x4(s) if mx_scales else s))


def ds_mla_values(spec: V.ValueSpec) -> tuple[V.PartValues, V.PartValues, V.PartValues]:
    """The parts' encodings of a synthetic ``fp8_ds_mla`` row (``ds_mla_parts``):
    fp8 values ``v / s``, each tile's scale ``s`` - vLLM's fused writer's rule,
    ``2^ceil(log2(max(amax / 448, 1e-4)))`` (its floor on the scale, not on
    amax as the indexer's) - and bf16 RoPE values."""
    amax = abs(spec.mean) + 4.0 * spec.std
    s = math.ldexp(1.0, math.ceil(math.log2(max(amax / FP8_MAX, 1e-4))))
    return (V.PartValues(torch.float8_e4m3fn, scale=s), V.PartValues(torch.float32, constant=s),
            V.PartValues(torch.bfloat16))


def nvfp4_ds_mla_values(spec: V.ValueSpec) -> tuple[V.PartValues, V.PartValues, V.PartValues]:
    """The parts' encodings of a synthetic ``nvfp4_ds_mla`` row
    (``nvfp4_ds_mla_parts``): e2m1 values ``v / s``, e4m3 RoPE values, and
    the e4m3 scale ``s`` of vLLM's writer for values of the fill's spread
    (``max(amax / 6, 2^-9)`` rounded to e4m3, amax = ``|mean| + 4 std``)."""
    amax = abs(spec.mean) + 4.0 * spec.std
    s = float(torch.tensor(max(amax / 6.0, 2.0 ** -9), dtype=torch.float32, device="cpu").to(torch.float8_e4m3fn))
    return (V.PartValues(torch.float4_e2m1fn_x2, scale=s), V.PartValues(torch.float8_e4m3fn),
            V.PartValues(torch.float8_e4m3fn, constant=s))
