"""The synthetic-KV value function, shared by every backend.

A value is a pure function of ``(seed, layer, token position t, element e)``,
where ``e`` indexes the token's row of the layer (all elements of that layer
that belong to one token, in logical order).  Nothing depends on the physical
block, the DCP rank or the launch shape.

Generator ("hashed window into a normal pool")
------------------------------------------------
* A pool of ``POOL_SIZE`` = 2**18 standard-normal samples is made once, on the
  host, from an integer generator (splitmix64 -> two uniforms -> Box-Muller in
  float64) and standardised to sample mean 0 and sample std 1 exactly.
* The values a mode stores are computed on the host from that pool in float64
  (``mean + std * z``), rounded to float32, clamped to the storage dtype's
  finite range and rounded to nearest-even into the storage dtype by torch.
  The result is a small table of *storage bits* per (mean, std, dtype).
* Token row ``t`` of layer ``l`` reads that table starting at a hashed offset:
  ``value(t, e) = table[(start(t) + e) mod POOL_SIZE]`` with
  ``start(t) = ((lowbias32(key(seed, l) + t) + elem_offset) mod POOL_SIZE)``
  rounded down to a multiple of ``ROW_ALIGN`` - one 32-bit integer hash per
  row.  ``elem_offset`` continues the element index across the tensors of a
  state list; the alignment lets a GPU read the table with vector loads.

Why: the kernels do no floating-point work at all (a row hash, a gather from a
table that stays in L2, a store of raw bits), so every backend - the Triton
interpreter, a GPU, the torch backend - stores bit-identical bytes, and the
interpreter's broken bf16/fp8 casts never run.  The cost per element is two
integer ops and an L2-resident load, so a random fill is as cheap as a constant
one.  The price is that the pool repeats: two rows whose offsets are close share
a shifted window of samples.  Neighbouring elements and neighbouring tokens are
still independent samples (different pool entries), which is what attention
benchmarks need; the measured figures are in README.md.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

POOL_BITS = 18
POOL_SIZE = 1 << POOL_BITS
POOL_MASK = POOL_SIZE - 1
ROW_ALIGN = 16  # row starts are multiples of this many table entries
START_MASK = POOL_MASK & ~(ROW_ALIGN - 1)
MASK32 = 0xFFFFFFFF

# Modes of a fill.
ZERO = "zero"
CONSTANT = "constant"
NORMAL = "normal"
REPLAY = "replay"  # rows of a recorded bank (bank.py), not a value function
MODES = (ZERO, CONSTANT, NORMAL, REPLAY)

# How the bytes of a cache tensor encode values.
ENC_AUTO = "auto"
ENC_NATIVE = "native"      # the tensor's own float dtype
ENC_FP8_E4M3 = "fp8_e4m3"  # fp8 e4m3fn stored in uint8 (or a native fp8 tensor)
ENC_FP8_E5M2 = "fp8_e5m2"
# fp8 e4m3fnuz in uint8: vLLM's fp8/fp8_e4m3 caches where the platform's fp8
# type is fnuz (ROCm MI300).  In e4m3fn 0x80 is -0.0; in fnuz it is NaN.
ENC_FP8_E4M3FNUZ = "fp8_e4m3fnuz"
ENC_PACKED = "packed"      # nvfp4, fp8 with embedded scales, int metadata: zero-filled
ENCODINGS = (ENC_AUTO, ENC_NATIVE, ENC_FP8_E4M3, ENC_FP8_E5M2, ENC_FP8_E4M3FNUZ, ENC_PACKED)

FLOAT_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
)
_FP8_OF_ENCODING = {
    ENC_FP8_E4M3: torch.float8_e4m3fn,
    ENC_FP8_E5M2: torch.float8_e5m2,
    ENC_FP8_E4M3FNUZ: torch.float8_e4m3fnuz,
}
# The integer dtype whose bits the kernels move for a given element size.
BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ValueSpecError(ValueError):
    """A bad fill parameter; ``field`` names it, so callers can name their own key."""

    def __init__(self, field: str, value, expected: str):
        super().__init__(f"{field} must be {expected}, got {value!r}")
        self.field, self.value, self.expected = field, value, expected


@dataclass(frozen=True)
class ValueSpec:
    """What a fill writes: ``std == 0``: the constant ``mean``; ``std > 0``:
    ``mean + std * z`` with ``z`` standard normal, reproducible from ``seed``.
    Validated once, here."""

    mean: float = 0.015
    std: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for name in ("mean", "std"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueSpecError(name, v, "a finite number")
        if self.std < 0:
            raise ValueSpecError("std", self.std, "a finite number >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueSpecError("seed", self.seed, "an int >= 0")
        object.__setattr__(self, "mean", float(self.mean))
        object.__setattr__(self, "std", float(self.std))

    @property
    def mode(self) -> str:
        return NORMAL if self.std > 0.0 else CONSTANT


PART_DTYPES = FLOAT_DTYPES + (torch.float4_e2m1fn_x2,)  # float4: e2m1 pairs (value_tables.py)
# A part whose rows must rarely repeat (an indexer's keys, which a top-k
# scores): 2**22 table entries, 2**18 row starts - two of L positions share a
# row with probability about L**2 / 2**19, not L**2 / 2**15.
PARTS_POOL_BITS = 22


def pool_bits(part: "PartValues | None") -> int:
    """The value table's size, ``2**pool_bits``, of a packed row's part
    (its own) or of whole rows (None: ``POOL_BITS``)."""
    return part.pool_bits if part is not None else POOL_BITS


@dataclass(frozen=True)
class PartValues:
    """How one part of a packed token row encodes values - the rows vLLM's
    DeepSeek formats write (``packed_rows.py``): fp8 values divided by a
    per-token power-of-two scale, the scale itself as float32 bytes, a bf16
    part as bytes.

    ``vdtype``: the float dtype of the part's values; a uint8 tensor holds
    them as their little-endian bytes when ``vdtype`` is wider.  ``scale``:
    a fill's value ``v`` is stored as ``v / scale`` (a power of two: exact),
    so the part decodes, times its scale, to the fill's values.
    ``constant``: the part holds this value whatever the fill's mean and std
    (the scale a part of values is divided by); zero and replay fills write
    zeros and recorded bytes as for any tensor."""

    vdtype: torch.dtype
    scale: float = 1.0
    constant: float | None = None
    pool_bits: int = POOL_BITS  # its table's entries: 2**pool_bits (more distinct rows: PARTS_POOL_BITS)

    def __post_init__(self):
        if not POOL_BITS <= self.pool_bits <= PARTS_POOL_BITS:
            raise ValueError(f"PartValues.pool_bits must be in [{POOL_BITS}, {PARTS_POOL_BITS}], got {self.pool_bits}")
        if self.vdtype not in PART_DTYPES:
            raise ValueError(f"PartValues.vdtype must be one of {[str(d) for d in PART_DTYPES]}, got {self.vdtype}")
        for name in ("scale", "constant"):
            v = getattr(self, name)
            if v is not None and (not math.isfinite(v) or (name == "scale" and v <= 0)):
                raise ValueError(f"PartValues.{name} must be a finite number{' > 0' if name == 'scale' else ''}, "
                                 f"got {v!r}")

    def storage_ratio(self, dtype: torch.dtype) -> int:
        """Storage elements per value in a tensor of ``dtype`` (1: the value
        dtype itself or fp8 in bytes; 2 or 4: a wider float's bytes)."""
        width = torch.empty((), dtype=self.vdtype, device="cpu").element_size()
        if dtype == self.vdtype or (dtype in (torch.uint8, torch.int8) and width == 1):
            return 1
        if dtype == torch.uint8:
            return width
        raise ValueError(f"a part of {self.vdtype} values needs a {self.vdtype} or uint8 tensor, got {dtype}")


def value_dtype(dtype: torch.dtype, encoding: str = ENC_AUTO) -> torch.dtype | None:
    """The float dtype whose values a cache of ``dtype`` holds; None: zero-filled.

    ``auto``: float dtypes hold themselves, ``uint8`` holds fp8 e4m3fn (vLLM's
    ``fp8`` cache dtype stored as bytes).  ``packed`` zero-fills any dtype.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding {encoding!r} is not one of {ENCODINGS}")
    if encoding == ENC_PACKED:
        return None
    if encoding in _FP8_OF_ENCODING:
        fp8 = _FP8_OF_ENCODING[encoding]
        if dtype not in (torch.uint8, torch.int8, fp8):
            raise ValueError(
                f"encoding {encoding!r} needs a uint8 or {fp8} cache, got dtype {dtype}"
            )
        return fp8
    if dtype in FLOAT_DTYPES:
        return dtype
    if dtype == torch.uint8 and encoding == ENC_AUTO:
        return torch.float8_e4m3fn
    raise ValueError(
        f"cache dtype {dtype} with encoding {encoding!r} is not supported: expected "
        f"one of {[str(d) for d in FLOAT_DTYPES]}, uint8 with encoding "
        f"'fp8_e4m3'/'fp8_e5m2', or encoding 'packed' (zero fill) for any dtype"
    )


def lowbias32(x: int) -> int:
    """A 32-bit integer bijection with good avalanche (C. Wellons' lowbias32)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    x ^= x >> 16
    return x


def lowbias32_np(x: np.ndarray) -> np.ndarray:
    """``lowbias32`` over a uint64 array holding 32-bit values."""
    x = x.astype(np.uint64) & np.uint64(MASK32)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(MASK32)
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & np.uint64(MASK32)
    x ^= x >> np.uint64(16)
    return x


def layer_key(seed: int, layer: int) -> int:
    """The 32-bit key of one layer's rows under ``seed`` (any Python int)."""
    if seed < 0 or layer < 0:
        raise ValueError(f"seed ({seed}) and layer ({layer}) must be >= 0")
    k = lowbias32((seed & MASK32) ^ 0x5BD1E995)
    k = lowbias32(k ^ ((seed >> 32) & MASK32))
    return lowbias32(k + ((layer * 0x9E3779B9) & MASK32))


def row_offsets(key: int, positions: np.ndarray, elem_offset: int = 0, pool_bits: int = POOL_BITS) -> np.ndarray:
    """Table index of element 0 of each token row: ``start(t)`` above (in a
    table of ``2**pool_bits`` entries: a packed row part's may be larger)."""
    t = np.asarray(positions, dtype=np.uint64)
    h = lowbias32_np(t + np.uint64(key))
    mask = ((1 << pool_bits) - 1) & ~(ROW_ALIGN - 1)
    return ((h + np.uint64(elem_offset)) & np.uint64(mask)).astype(np.int64)


@functools.lru_cache(maxsize=2)
def standard_normal_pool(bits: int = POOL_BITS) -> np.ndarray:
    """``2**bits`` float64 samples (POOL_SIZE by default), mean exactly 0 and std exactly 1."""
    n = (1 << bits) // 2
    idx = np.arange(2 * n, dtype=np.uint64)
    # splitmix64 over the counter: the same bits on every machine and numpy.
    z = idx * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x6A09E667F3BCC909)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))
    u1, u2 = u[:n], u[n:]
    r = np.sqrt(-2.0 * np.log(u1))
    pool = np.concatenate([r * np.cos(2 * math.pi * u2), r * np.sin(2 * math.pi * u2)])
    pool -= pool.mean()
    pool /= pool.std()
    return pool


def encode(values: torch.Tensor | np.ndarray, vdtype: torch.dtype) -> torch.Tensor:
    """float64 values -> storage bits of ``vdtype`` (float32 rounding, clamp, RNE)."""
    x = torch.as_tensor(values, dtype=torch.float64, device="cpu").to(torch.float32)
    fmax = torch.finfo(vdtype).max
    x = x.clamp(-fmax, fmax)
    bits = BITS_DTYPE[torch.empty((), dtype=vdtype).element_size()]
    return x.to(vdtype).view(bits)


@functools.lru_cache(maxsize=64)
def host_table(mode: str, mean: float, std: float, vdtype: torch.dtype | None, itemsize: int) -> torch.Tensor:
    """The storage bits a mode draws from, on the host: the encoded pool
    (normal, ``POOL_SIZE`` entries) or one entry (constant / zero)."""
    if mode == ZERO or vdtype is None:
        return torch.zeros(1, dtype=BITS_DTYPE[itemsize], device="cpu")
    if mode == CONSTANT:
        return encode(np.array([mean]), vdtype)
    if mode == NORMAL:
        return encode(mean + std * standard_normal_pool(), vdtype)
    raise ValueError(f"mode {mode!r} is not one of {MODES}")
