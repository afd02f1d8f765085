"""Loading the bank a serving run replays, and what it logs about it:
provenance that differs from the run's own settings, and recorded values that
are not finite.

Neither refuses the bank - a bank recorded with another ``max_model_len``
still replays real KV, only not bit for bit - but the replayed bits depend on
them (the README's replay section), so a mismatch is said at startup.
"""
from __future__ import annotations

from typing import Mapping

import torch
from vllm.logger import init_logger

from kvfill.kernels import Bank
from kvfill.kernels.bank import dtype_name

logger = init_logger("vllm.kvfill.connector")


def load_bank(path: str, *, model: str, max_model_len: int, kv_cache_dtype: str) -> Bank:
    """The bank in this process's memory, with a warning per mismatch above."""
    bank = Bank.load(path)
    logger.info("KVFillConnector: replaying %s", bank.describe())
    for line in provenance_mismatches(bank.metadata, model=model, max_model_len=max_model_len,
                                      kv_cache_dtype=kv_cache_dtype):
        logger.warning("KVFillConnector: %s", line)
    line = nonfinite_warning(bank.source, count_nonfinite(bank))
    if line:
        logger.warning("KVFillConnector: %s", line)
    return bank


def provenance_mismatches(meta: Mapping[str, str], *, model: str, max_model_len: int,
                          kv_cache_dtype: str) -> list[str]:
    """One line per recorded setting that differs from the serving run's."""
    serving = {"model": str(model), "max_model_len": str(max_model_len), "kv_cache_dtype": str(kv_cache_dtype)}
    out = []
    for key, value in serving.items():
        recorded = meta.get(key)
        if recorded is None or recorded == "auto" or recorded == value:
            continue
        out.append(f"the bank was recorded with {key}={recorded!r}, this run has {key}={value!r}: replayed rows "
                   f"are real KV but not bit-identical to this run's prefill")
    return out


def nonfinite_warning(source: str, counts: Mapping[str, int]) -> str | None:
    """A line naming the layers whose recorded rows hold NaN or inf (None: none do)."""
    if not counts:
        return None
    worst = sorted(counts.items(), key=lambda kv: -kv[1])[:3]
    return (f"{source}: {sum(counts.values())} recorded values are NaN or infinite in {len(counts)} layers "
            f"(e.g. {', '.join(f'{n}: {c}' for n, c in worst)}); they are replayed as recorded")


def count_nonfinite(bank: Bank) -> dict[str, int]:
    """Layer -> how many of its recorded values are NaN or infinite
    (decoded through the layer's value dtype; layers of raw bits are not
    counted).  A bank holding them replays them silently otherwise."""
    out = {}
    for name, t in bank.layers.items():
        vdtype = bank.value_dtypes.get(name) or dtype_name(t.dtype)
        target = getattr(torch, vdtype, None)
        if not isinstance(target, torch.dtype) or not target.is_floating_point:
            continue
        flat = t.reshape(-1)
        if t.dtype != target:
            if t.element_size() != torch.empty((), dtype=target, device="cpu").element_size():
                continue
            flat = flat.view(target)
        bad = 0
        for a in range(0, flat.numel(), 1 << 24):  # bounded temporaries
            bad += int((~torch.isfinite(flat[a:a + (1 << 24)].float())).sum())
        if bad:
            out[name] = bad
    return out
