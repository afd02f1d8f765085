"""Loading the bank a serving run replays: this rank's part of it
(``rank_part``), kept on the GPU or in host memory by where it fits beside
what vLLM still allocates (``bank_fit.choose_placement``) or refused, and
what is logged about it: where it is kept and why, its size, provenance
that differs from the run's own settings, and recorded values that are not
finite.

Provenance and values do not refuse the bank - a bank recorded with another
``max_model_len`` or compilation mode (``compilation_of``) still replays
real KV, only not bit for bit - but the
replayed bits depend on them (the README's replay section), so a mismatch is
said at startup.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping

import torch
from vllm.logger import init_logger

from kvfill.bank import NO_DCP, Bank, BankError, BankPart, dtype_name
from kvfill.kernels import CacheGroup
from kvfill.kernels.packed_rows import part_dtypes

from .bank_fit import allocatable, choose_placement
from .drafter import check_drafter

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger("vllm.kvfill.connector")


def rank_part(groups: Mapping[str, CacheGroup], tp_rank: int, tp_size: int,
              max_positions: int | None = None) -> BankPart:
    """What this rank replays (``kvfill/bank/parts.py``): its TP rank's
    KV heads, the layers of its replaying groups (its pipeline stage's), those
    groups' DCP positions, and positions below ``max_positions`` (the serving
    max_model_len: rows past it are never read)."""
    replayed = [g for g in groups.values() if g.mode is None]  # the engine's mode: replay
    dcps = {g.dcp for g in replayed if g.dcp.sharded}
    single = frozenset(n for g in replayed for n in g.layers if (g.kv_of(n) or (0,))[0] == 1)
    return BankPart(tp_rank, tp_size, frozenset(n for g in replayed for n in g.layers),
                    dcps.pop() if len(dcps) == 1 else NO_DCP, whole_layers=single,  # several DCPs: refused
                    max_positions=max_positions)


def load_bank(path: str, part: BankPart, vllm_config: "VllmConfig", device: torch.device,
              placement: str = "device", staging_bytes: int = 256 << 20, rotate: bool = False,
              caches_outside_torch: int = 0, tables: int = 0) -> tuple[Bank, str]:
    """This rank's part of the bank in this process's memory and where the
    fill keeps its rows (``placement`` asked: ``auto``, ``device`` or
    ``host``; ``bank_fit.choose_placement``; ``rotate``: past_bank
    "rotate"; ``caches_outside_torch``: bytes of vLLM's caches its torch
    allocator does not hold, ``bank_loading.caches_outside_torch``;
    ``tables``: bytes of the rotary tables re-rotation keeps on the device,
    counted in every placement), decided
    from the file's header before a row is read and logged with why; with a
    warning per mismatch above."""
    chosen = {"where": "host" if placement == "host" else "device",
              "why": f"bank_placement {placement!r}: the caches are in host memory, where the bank is read"}
    fits = None
    if device.type == "cuda":
        cache = vllm_config.cache_config

        def fits(rows: int, states: int) -> str | None:
            free, total = torch.cuda.mem_get_info(device)
            reserved = torch.cuda.memory_reserved(device)
            cap = torch.cuda.get_per_process_memory_fraction(device)  # vLLM 0.34 caps torch beside its cache
            where, line = choose_placement(placement, rows=rows, states=states, staging=staging_bytes,
                                           free=free, torch_free=allocatable(free, total, reserved, cap), total=total,
                                           utilization=server_utilization(cache), held=reserved + caches_outside_torch,
                                           kv_cache_memory_bytes=getattr(cache, "kv_cache_memory_bytes", None),
                                           rotate=rotate, tables=tables,
                                           extensible=bool(getattr(cache, "enable_extensible_kv_cache", False)))
            chosen.update(where=where, why=line)
            return None if where else line
    elif placement == "host":
        chosen["why"] = ("bank_placement 'host': the caches are in host memory too; each step's rows are still "
                         "staged (a copy per step, no memory saved)")

    bank = Bank.load(path, part, fits)
    logger.info("KVFillConnector: bank kept on the %s - %s", "caches' device" if chosen["where"] == "device"
                else "host", chosen["why"])
    check_drafter_layers(bank, part, vllm_config)
    for line in check_drafter(bank.metadata, getattr(vllm_config, "speculative_config", None), bank.source):
        logger.warning("KVFillConnector: %s", line)
    logger.info("KVFillConnector: replaying %s", bank.describe())
    model = vllm_config.model_config
    for line in provenance_mismatches(bank.metadata, model=str(model.model), max_model_len=model.max_model_len,
                                      kv_cache_dtype=vllm_config.cache_config.cache_dtype,
                                      compilation=compilation_of(vllm_config)):
        logger.warning("KVFillConnector: %s", line)
    line = nonfinite_warning(bank.source, count_nonfinite(bank))
    if line:
        logger.warning("KVFillConnector: %s", line)
    return bank, chosen["where"]


def server_utilization(cache) -> float:
    """vLLM's memory budget as a fraction of the GPU: the user's
    ``--gpu-memory-utilization``, else the default vLLM resolves (vLLM 0.34
    leaves the flag None: 1.0 under its extensible KV cache, else 0.92;
    ``CacheConfig.resolved_gpu_memory_utilization``)."""
    resolved = getattr(cache, "resolved_gpu_memory_utilization", None)
    return float(cache.gpu_memory_utilization if resolved is None else resolved)


def check_drafter_layers(bank: Bank, part: BankPart, vllm_config: "VllmConfig") -> None:
    """A run with a speculative drafter replays the drafter's KV cache
    layers too; a bank recorded without the drafter has no rows for them:
    BankError naming the way out (record with the same speculative config)."""
    spec = getattr(vllm_config, "speculative_config", None)
    missing = sorted(set(part.layers or ()) - set(bank.layers) - set(bank.states))
    if spec is None or not missing:
        return
    recorded = bank.metadata.get("speculative_config") or "none"
    raise BankError(f"{bank.source}: has no rows for {len(missing)} KV cache layer(s) of this engine "
                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}), and this engine runs "
                    f"speculative decoding (method {getattr(spec, 'method', None)!r}) whose drafter caches KV there; "
                    f"the bank was recorded with speculative config {recorded}. Record the bank with the serving "
                    f"run's --speculative-config (kvfill-record takes it and records the drafter's layers too)")


def provenance_mismatches(meta: Mapping[str, str], *, model: str, max_model_len: int,
                          kv_cache_dtype: str, compilation: str | None = None) -> list[str]:
    """One line per recorded setting that differs from the serving run's
    (``compilation``: ``compilation_of`` the serving engine; a bank that
    does not record it is not compared)."""
    serving = {"model": str(model), "max_model_len": str(max_model_len), "kv_cache_dtype": str(kv_cache_dtype)}
    if compilation is not None:
        serving["compilation"] = compilation
    out = []
    for key, value in serving.items():
        recorded = meta.get(key)
        if recorded is None or recorded == "auto" or recorded == value:
            continue
        out.append(f"the bank was recorded with {key}={recorded!r}, this run has {key}={value!r}: replayed rows "
                   f"are real KV but not bit-identical to this run's prefill{_HINTS.get(key, '')}")
    return out


# What to do about a mismatch where the flag's name is not the key's.
_HINTS = {"compilation": " (eager and compiled kernels round differently; kvfill-record runs as vLLM's defaults "
                         "compile, and eager with --enforce-eager: record with this run's compilation flags)"}


def compilation_of(vllm_config: "VllmConfig") -> str:
    """The engine's compilation as it decides the numerics of a forward
    pass: vLLM's compilation mode, its backend when compiled, and which
    custom ops run (vLLM's resolved ``custom_ops``: ``all`` eager,
    ``none`` under Inductor unless asked).  The recorder writes it into a
    bank's provenance; the serving engine compares its own."""
    from vllm.config import CompilationMode

    cc = vllm_config.compilation_config
    mode = CompilationMode(int(cc.mode)).name
    backend = "" if mode == "NONE" else f" backend={cc.backend or 'default'}"
    return f"mode={mode}{backend} custom_ops={','.join(cc.custom_ops) or 'default'}"


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
    counted), and ``"<layer> (state)"`` -> those of its recorded state.  A
    bank holding them replays them silently otherwise."""
    out = {}
    for name, t in bank.layers.items():
        vdtype = bank.value_dtypes.get(name) or dtype_name(t.dtype)
        target = getattr(torch, vdtype, None)
        if not isinstance(target, torch.dtype) or not target.is_floating_point:
            bad = _nonfinite_packed(t, bank.parts.get(name))  # DeepSeek's rows: each part its own dtype
            if bad:
                out[name] = bad
            continue
        flat = t.reshape(-1)
        if t.dtype != target:
            if t.element_size() != torch.empty((), dtype=target, device="cpu").element_size():
                continue
            flat = flat.view(target)
        bad = _nonfinite(flat)
        if bad:
            out[name] = bad
    for name, tensors in bank.states.items():  # recorded recurrent state, replayed into every request alike
        bad = sum(_nonfinite(t.reshape(-1)) for t in tensors if t.is_floating_point())
        if bad:
            out[f"{name} (state)"] = bad
    return out


def _nonfinite_packed(rows: torch.Tensor, parts) -> int:
    """NaN or inf in a packed layer's rows ``[T, R]`` of bytes, each part's
    columns read as the dtype it encodes (``packed_rows.part_dtypes``); 0
    for rows of another kind."""
    dtypes = part_dtypes(parts)
    if dtypes is None or rows.dim() != 2 or rows.element_size() != 1:
        return 0
    widths = [math.prod(p) for p in parts]
    if sum(widths) != rows.shape[1]:
        return 0
    bad, at = 0, 0
    for width, dtype in zip(widths, dtypes):
        if dtype is not None:
            step = max(1, (1 << 24) // width)  # bounded temporaries
            for a in range(0, rows.shape[0], step):
                values = rows[a:a + step, at:at + width].contiguous().view(torch.uint8).view(dtype)
                bad += int((~torch.isfinite(values.float())).sum())
        at += width
    return bad


def _nonfinite(flat: torch.Tensor) -> int:
    bad = 0
    for a in range(0, flat.numel(), 1 << 24):  # bounded temporaries
        bad += int((~torch.isfinite(flat[a:a + (1 << 24)].float())).sum())
    return bad
