"""Loading the bank a serving run replays: this rank's part of it
(``rank_part``), refused when it does not fit the GPU beside what vLLM still
allocates (``fit_error``), and what is logged about it: its size, provenance
that differs from the run's own settings, and recorded values that are not
finite.

Provenance and values do not refuse the bank - a bank recorded with another
``max_model_len`` still replays real KV, only not bit for bit - but the
replayed bits depend on them (the README's replay section), so a mismatch is
said at startup.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping

import torch
from vllm.logger import init_logger

from kvfill.kernels import NO_DCP, Bank, CacheGroup
from kvfill.kernels.bank import dtype_name
from kvfill.kernels.bank_part import BankPart

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.kvfill.connector")


def rank_part(groups: Mapping[str, CacheGroup], tp_rank: int, tp_size: int) -> BankPart:
    """What this rank replays (``kvfill/kernels/bank_part.py``): its TP rank's
    KV heads, the layers of its replaying groups (its pipeline stage's), and
    those groups' DCP positions."""
    replayed = [g for g in groups.values() if g.mode is None]  # the engine's mode: replay
    dcps = {g.dcp for g in replayed if g.dcp.sharded}
    single = frozenset(n for g in replayed for n in g.layers if (g.kv_of(n) or (0,))[0] == 1)
    return BankPart(tp_rank, tp_size, frozenset(n for g in replayed for n in g.layers),
                    dcps.pop() if len(dcps) == 1 else NO_DCP, whole_layers=single)  # several DCPs: refused



def load_bank(path: str, part: BankPart, vllm_config: "VllmConfig", device: torch.device) -> Bank:
    """This rank's part of the bank in this process's memory, after checking
    it fits the device beside vLLM's budget, with a warning per mismatch above."""
    fits = None
    if device.type == "cuda":  # checked from the file's header, before a row is read
        cache = vllm_config.cache_config

        def fits(nbytes: int) -> str | None:
            free, total = torch.cuda.mem_get_info(device)
            return fit_error(nbytes, free=free, total=total, utilization=cache.gpu_memory_utilization,
                             kv_cache_memory_bytes=getattr(cache, "kv_cache_memory_bytes", None))

    bank = Bank.load(path, part, fits)
    logger.info("KVFillConnector: replaying %s", bank.describe())
    model = vllm_config.model_config
    for line in provenance_mismatches(bank.metadata, model=str(model.model), max_model_len=model.max_model_len,
                                      kv_cache_dtype=vllm_config.cache_config.cache_dtype):
        logger.warning("KVFillConnector: %s", line)
    line = nonfinite_warning(bank.source, count_nonfinite(bank))
    if line:
        logger.warning("KVFillConnector: %s", line)
    return bank


def fit_error(nbytes: int, *, free: int, total: int, utilization: float,
              kv_cache_memory_bytes: int | None) -> str | None:
    """Why a bank of ``nbytes`` cannot be uploaded next to vLLM's caches (None: it fits).

    vLLM sizes the KV cache to leave, inside ``gpu_memory_utilization`` of the
    GPU, what it allocates after registering the caches: the CUDA graphs it
    captures in ``compile_or_warm_up_model`` (``profile_cudagraph_memory``'s
    estimate) and the forward's activations.  That memory is free now but
    spoken for, so the bank must fit in what lies outside vLLM's share:
    ``free - (utilization x total - used)``.  With ``--kv-cache-memory-bytes``
    vLLM does not size by utilization (nor know what it allocates later); the
    same share is kept, so a smaller KV cache makes room only where that share
    is used up, and a lower utilization otherwise.
    """
    used = total - free
    spoken_for = max(0, int(utilization * total) - used)
    room = free - spoken_for
    if nbytes <= room:
        return None
    short, gib = nbytes - room, 2**30
    ways = []
    lower = math.floor((utilization - short / total) * 100) / 100
    if lower > 0 and not kv_cache_memory_bytes:  # vLLM sizes its KV cache that much smaller
        ways.append(f"--gpu-memory-utilization {lower:.2f} or lower (a KV cache that much smaller)")
    elif lower > 0 and spoken_for > 0:  # the share kept for vLLM that much smaller
        ways.append(f"--gpu-memory-utilization {lower:.2f} or lower")
    if kv_cache_memory_bytes and spoken_for == 0 and kv_cache_memory_bytes > short:
        ways.append(f"--kv-cache-memory-bytes {kv_cache_memory_bytes - short} or lower")
    ways.append("record fewer sequences or positions, or split the bank over more ranks (TP for heads, PP for "
                "layers, DCP for positions)")
    return (f"this rank's part of the bank takes {nbytes / gib:.2f} GiB; the GPU has {free / gib:.2f} GiB free, "
            f"{spoken_for / gib:.2f} GiB of them kept for what vLLM allocates after registering its caches (CUDA "
            f"graphs, activations: inside --gpu-memory-utilization {utilization}), leaving {room / gib:.2f} GiB. "
            f"Make room for {short / gib:.2f} GiB more: " + "; or ".join(ways))


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
