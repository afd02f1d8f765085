"""vLLM's packed caches, filled as their readers expect, and the caches kvfill
still leaves zeroed, named at start.

* ``packed_row_kind``: which layers hold DeepSeek's sparse-attention rows -
  the DeepSeek-V3.2 / GLM-5 indexer K cache (an ``MLAAttentionSpec`` of cache
  role ``INDEXER``, uint8, 128 fp8 key bytes + a 4-byte scale per token, not
  compressed) and ``fp8_ds_mla`` latent rows (656 B) - registered as the
  per-token views of ``kernels/packed_rows.py`` (``packed_views``) with
  synthetic values that decode to keys (``packed_encoding``), recorded and
  replayed byte for byte; ``nvfp4_ds_mla`` rows (352 B) likewise.  ``zero_packed`` (an option) keeps zeros for them,
  as the in-tree DecodeBenchConnector writes.
* ``zeroed_line``: one warning naming the attention layers a fill leaves
  zero (packed formats kvfill does not know: nvfp4, DeepSeek-V4's compressed
  caches, ...) and what that does to a benchmark.
* ``check_packed_rows``: replaying, a bank without rows for a packed layer
  this engine fills is refused, naming the layers and the way out; the
  indexer rows it holds are converted to the scale encoding this engine's
  vLLM reads (``match_indexer_scales``).
* ``indexer_scale_encoding``: how this platform's vLLM stores an indexer
  token's scale - float32, or four UE8M0 bytes (vLLM 0.34 on SM100) - what
  the recorder writes into a bank's provenance (``INDEXER_SCALES_KEY``).
* ``refused_layout`` / ``refused_line`` / ``refuse_layouts``: caches whose page layout kvfill
  cannot address a token in - vLLM 0.34's head-major K/V slots (``H2ND``,
  MiniMax-M3's NVFP4 KV cache) - refused when the worker starts.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping

import torch

from kvfill.bank import Bank, BankError, BankPart
from kvfill.kernels import RowParts
from kvfill.kernels import values as V
from kvfill.kernels.packed_rows import (
    DS_MLA_ROW,
    NVFP4_DS_MLA_ROW,
    SCALE_BYTES,
    SCALES_FLOAT32,
    SCALES_UE8M0_X4,
    convert_indexer_scales,
    ds_mla_parts,
    ds_mla_values,
    indexer_parts,
    indexer_values,
    nvfp4_ds_mla_parts,
    nvfp4_ds_mla_values,
)

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheSpec

# Under "vllm." so that vLLM's logging configuration (handlers, level) applies.
logger = logging.getLogger("vllm.kvfill.connector")

INDEXER = "indexer"
FP8_DS_MLA = "fp8_ds_mla"
NVFP4_DS_MLA = "nvfp4_ds_mla"
INDEXER_KEY_DIM = 128  # DeepSeek-V3.2 / GLM-5: index_head_dim, one fp8 scale per 128 keys


def packed_row_kind(spec: "KVCacheSpec") -> str | None:
    """``INDEXER``, ``FP8_DS_MLA``, ``NVFP4_DS_MLA`` or None (not a packed row kvfill knows)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if not isinstance(spec, MLAAttentionSpec) or getattr(spec, "tokens_per_state", 1) != 1:
        return None  # compressed caches (DeepSeek-V4, GLM-5-Next's kpool) hold states of several tokens
    role = getattr(getattr(spec, "cache_role", None), "value", getattr(spec, "cache_role", None))
    if str(role).lower() == "indexer" and spec.dtype == torch.uint8 \
            and spec.head_size == INDEXER_KEY_DIM + SCALE_BYTES and not _rocm():
        return INDEXER  # (ROCm's AITER indexer may shuffle its pages: not this layout, left zero and named)
    if getattr(spec, "cache_dtype_str", None) == "fp8_ds_mla" and spec.dtype == torch.uint8 \
            and getattr(spec, "state_content_bytes", None) == DS_MLA_ROW:
        return FP8_DS_MLA
    if getattr(spec, "cache_dtype_str", None) == "nvfp4_ds_mla" and spec.dtype == torch.uint8 \
            and getattr(spec, "state_content_bytes", None) == NVFP4_DS_MLA_ROW:
        return NVFP4_DS_MLA
    return None


def _rocm() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_rocm()


def packed_views(kind: str, cache: Any) -> RowParts:
    """A packed layer's cache as the per-token views the engine fills."""
    if kind == INDEXER:
        return indexer_parts(cache)
    return ds_mla_parts(cache) if kind == FP8_DS_MLA else nvfp4_ds_mla_parts(cache)


def packed_encoding(kind: str, values: V.ValueSpec, *, zero: bool) -> Any:
    """How each view of a packed layer encodes what is written: zeros when
    asked (``zero``), else the parts' encodings of a synthetic fill of
    ``values`` (a replay moves the recorded bytes whatever they encode)."""
    if zero:
        return V.ENC_PACKED
    if kind == INDEXER:
        return indexer_values(values, mx_scales=indexer_mx_scales())
    return ds_mla_values(values) if kind == FP8_DS_MLA else nvfp4_ds_mla_values(values)


def indexer_mx_scales() -> bool:
    """Whether vLLM's indexer writers store each token's scale as four UE8M0
    bytes (vLLM 0.34 on SM100: ``mqa_logits_use_mx_scales``) rather than
    float32 (vLLM 0.32, and 0.34 elsewhere)."""
    try:
        from vllm.utils.deep_gemm import mqa_logits_use_mx_scales
    except ImportError:
        return False
    return bool(mqa_logits_use_mx_scales())


# A bank's provenance key naming how its indexer rows store their scales (``packed_rows.INDEXER_SCALES``).
INDEXER_SCALES_KEY = "indexer_scales"
_SCALES_ON = {SCALES_FLOAT32: "float32 (vLLM 0.32, and 0.34 off SM100)",
              SCALES_UE8M0_X4: "four UE8M0 bytes (vLLM 0.34 on SM100: B200/GB200)"}


def indexer_scale_encoding() -> str:
    """How this platform's vLLM stores an indexer token's scale
    (``indexer_mx_scales``): ``ue8m0_x4`` or ``float32``.  The recorder writes
    it into a bank's provenance; a replaying worker converts the bank's rows to it."""
    return SCALES_UE8M0_X4 if indexer_mx_scales() else SCALES_FLOAT32


def zeroed_line(specs: Mapping[str, "KVCacheSpec"], encodings: Mapping[str, Any]) -> str | None:
    """One line naming the attention layers whose caches a fill leaves zero
    (their bytes encode values kvfill does not know how to write), None if
    none: the benchmark then decodes over keys whose scores all tie."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    zeroed = sorted(n for n, s in specs.items() if isinstance(s, AttentionSpec) and encodings.get(n) == V.ENC_PACKED)
    if not zeroed:
        return None
    kinds = sorted({_describe(specs[n]) for n in zeroed})
    return (f"KVFillConnector: {len(zeroed)} attention cache layer(s) are left zero - {', '.join(kinds)}, a format "
            f"kvfill does not fill as its reader expects (e.g. {', '.join(zeroed[:2])}); a decode over them reads "
            f"zero keys (every score ties, e.g. a sparse indexer's top-k), so its step time may not be a real "
            f"prompt's")


H2ND = "H2ND"


def refused_layout(spec: "KVCacheSpec") -> str | None:
    """The name of a page layout kvfill refuses to fill, None for the rest:
    ``H2ND`` for vLLM 0.34's ``kv_head_major_slots`` (each KV head's K and V
    as two adjacent slots of the ``[B, H, N, C]`` page; H = 2 x KV heads).
    The one cache vLLM 0.34 lays out so, MiniMax-M3's NVFP4 KV cache, keeps
    in each slot the page's values, then the page's block scales: a view row
    ``[b, h, n, :]`` is not token n's bytes, so neither values, zeros nor
    recorded bytes can be written at token granularity."""
    if getattr(spec, "kv_head_major_slots", False):
        return H2ND
    return None


def refused_line(specs: Mapping[str, "KVCacheSpec"]) -> str | None:
    """One error naming the layers of a layout kvfill refuses (``refused_layout``)
    and the way out; None when there are none."""
    refused = sorted(n for n, s in specs.items() if refused_layout(s) is not None)
    if not refused:
        return None
    kinds = sorted({f"{refused_layout(specs[n])} ({_describe(specs[n])})" for n in refused})
    return (f"KVFillConnector: cannot fill {len(refused)} cache layer(s) laid out {', '.join(kinds)} - each KV "
            f"head's K and V as two adjacent slots (kv_head_major_slots, e.g. MiniMax-M3's NVFP4 KV cache): "
            f"{', '.join(refused[:3])}{', ...' if len(refused) > 3 else ''}. kvfill writes a token's bytes as one "
            f"row of each slot of vLLM's [B, H, N, C] view, and such a page keeps a slot's values and then its "
            f"scales for the whole page, so it would write other tokens' bytes. Serve it without kvfill's "
            f"connector, or with a --kv-cache-dtype its backend does not lay out head-major (auto, fp8)")


def refuse_layouts(specs: Mapping[str, "KVCacheSpec"], skip=()) -> None:
    """ValueError (``refused_line``) when a layer not in ``skip`` (groups
    kvfill never fills) has a layout kvfill refuses; the worker's first check."""
    line = refused_line({n: s for n, s in specs.items() if n not in skip})
    if line:
        raise ValueError(line)


def compressed_in_mixed_groups(kv_cache_groups, specs: Mapping[str, "KVCacheSpec"]) -> dict[str, int]:
    """Layers holding one state per several tokens (``tokens_per_state`` > 1:
    DeepSeek-V4's compressed caches, GLM-5-Next's kpool indexer) in a KV
    cache group with layers of another ratio: their pages hold another
    number of slots than the group's block table says, so the engine cannot
    fill them with the others; layer -> its ratio (left out, named at start)."""
    out = {}
    for g in kv_cache_groups:
        ratios = {n: getattr(specs.get(n), "tokens_per_state", 1) for n in g.layer_names if n in specs}
        if len(set(ratios.values())) > 1:
            out.update({n: r for n, r in ratios.items() if r != 1})
    return out


def left_out_line(left: Mapping[str, int]) -> str:
    return (f"KVFillConnector: {len(left)} cache layer(s) hold one state per several tokens in a KV cache group "
            f"with per-token layers (e.g. {', '.join(sorted(left)[:2])}: {sorted(set(left.values()))} tokens per "
            f"state); kvfill does not fill them: they keep what vLLM allocated (zeros), and a decode reading "
            f"them sees no prompt there")


def unrecordable_line(specs: Mapping[str, "KVCacheSpec"], encodings: Mapping[str, Any],
                      left_out: Mapping[str, int]) -> str | None:
    """Record role: one line naming the attention layers a recording cannot
    hold (zero-filled formats, compressed layers), None if it can hold all."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    bad = sorted(n for n, s in specs.items() if isinstance(s, AttentionSpec) and (
        encodings.get(n) == V.ENC_PACKED or n in left_out or getattr(s, "tokens_per_state", 1) != 1))
    if not bad:
        return None
    kinds = sorted({_describe(specs[n]) for n in bad})
    compressed = any(n in left_out or getattr(specs[n], "tokens_per_state", 1) != 1 for n in bad)
    way = ("kvfill does not record caches that hold one state per several tokens (DeepSeek-V4, GLM-5-Next's "
           "kpool): such a model cannot be recorded yet" if compressed else
           "record with a --kv-cache-dtype it covers (auto, fp8, fp8_ds_mla, nvfp4_ds_mla)")
    return (f"KVFillConnector: cannot record {len(bad)} cache layer(s) of this engine ({', '.join(bad[:2])}"
            f"{', ...' if len(bad) > 2 else ''}: {', '.join(kinds)}): kvfill reads and writes their bytes only in "
            f"formats it knows (docs/engine.md's coverage table); {way}")


def _describe(spec: "KVCacheSpec") -> str:
    what = getattr(spec, "cache_dtype_str", None) or str(getattr(spec, "dtype", "?")).removeprefix("torch.")
    role = getattr(getattr(spec, "cache_role", None), "value", None)
    extra = f", {role}" if role and str(role).lower() != "sparse" else ""
    per = getattr(spec, "tokens_per_state", 1)
    extra += f", {per} tokens per state" if per != 1 else ""
    return f"{type(spec).__name__} ({what}{extra})"


def check_packed_rows(bank: Bank, part: BankPart, packed: Mapping[str, str],
                      serving_scales: str | None = None) -> None:
    """Replaying: BankError when the bank has no rows for a packed layer this
    rank fills (recorded before kvfill recorded them, or zero-filled then);
    then its indexer rows converted to ``serving_scales`` (None: this
    platform's, ``indexer_scale_encoding``) by ``match_indexer_scales``."""
    missing = sorted(n for n in packed if n in (part.layers or ()) and n not in bank.layers)
    if not missing:
        match_indexer_scales(bank, packed, serving_scales)
        return
    kinds = sorted({packed[n] for n in missing})
    raise BankError(f"{bank.source}: has no rows for {len(missing)} sparse-attention cache layer(s) of this engine "
                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}: {', '.join(kinds)}), which "
                    f"its decode reads. Record the bank again with this kvfill (kvfill-record records them), or set "
                    f"kv_connector_extra_config zero_packed: true to give them zeros as the in-tree connector does "
                    f"(every indexer score then ties)")


def match_indexer_scales(bank: Bank, packed: Mapping[str, str], serving: str | None = None) -> int:
    """The bank's rows of this engine's indexer layers (``packed``: layer ->
    its kind) rewritten in place, in the bank's own memory, from the scale
    encoding the bank records (``INDEXER_SCALES_KEY``; a bank recorded before
    kvfill wrote it holds float32 scales, as every recording then did) into
    ``serving``'s (None: ``indexer_scale_encoding``), the bank's metadata
    then naming it: each row decodes to the recorded key, and everything
    after - replay's bytes, verify, re-rotation (which decodes with the
    serving encoding) - reads rows of the encoding vLLM reads here.
    BankError naming both encodings where a scale has no exact code in the
    serving one.  Returns the layers converted."""
    names = sorted(n for n, k in packed.items() if k == INDEXER and n in bank.layers)
    if not names:
        return 0
    serving = serving or indexer_scale_encoding()
    recorded = bank.metadata.get(INDEXER_SCALES_KEY)
    # a bank of an older kvfill: float32; were it UE8M0 bytes, no scale would read as a float32 power of two
    # (four equal bytes set mantissa bits, or are 0.0) and the conversion below would refuse it
    assumed = recorded is None
    recorded = SCALES_FLOAT32 if assumed else recorded
    if recorded not in _SCALES_ON:
        raise BankError(f"{bank.source}: records {INDEXER_SCALES_KEY}={recorded!r}; expected one of "
                        f"{list(_SCALES_ON)}")
    if recorded == serving:
        return 0
    for name in names:
        try:
            convert_indexer_scales(bank.layers[name], recorded, serving)
        except ValueError as exc:
            raise BankError(f"{bank.source}: layer {name!r} stores its indexer scales as {_SCALES_ON[recorded]}, "
                            f"this engine's vLLM reads {_SCALES_ON[serving]}, and they cannot be converted without "
                            f"loss: {exc}. Record the bank again on this platform") from None
    bank.metadata[INDEXER_SCALES_KEY] = serving  # what its rows hold now
    logger.info("KVFillConnector: %s: the scales of its %d indexer layers converted from %s%s to %s, as this "
                "engine's vLLM reads them (each key as recorded)", bank.source, len(names), _SCALES_ON[recorded],
                " (taken as float32: the bank does not record its indexer scale encoding, recorded before kvfill "
                "wrote it, when every recording held float32)" if assumed else "", _SCALES_ON[serving])
    return len(names)
