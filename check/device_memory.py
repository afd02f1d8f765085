"""The GPU memory an ``--in-process`` check holds when ``--serve`` starts a
server: released first, then weighed against what ``vllm serve`` asks.

A ``vllm serve`` worker refuses to start unless the GPU's free memory is at
least ``--gpu-memory-utilization`` x its total (vLLM's ``request_memory``,
measured after the worker's own CUDA context exists).  With ``--in-process``
the check's earlier engines ran here: their tensors go back to torch's
caching allocator once collected, which keeps them from every other process
until ``torch.cuda.empty_cache()``.  Where CUDA was never initialised here
(vLLM CPU, or steps in processes of their own) nothing is done.

And the room a replaying engine leaves its bank under vLLM 0.34's extensible
KV cache (``replay_room``), decided before the engine starts: that cache is
sized after warmup from the memory then free, and the connector that loads
the bank is created only afterwards (``connector/bank_fit.py``), so at the
default utilization (1.0) no bank has room and an engine started so warms up
to be refused.  The budget's slack ``init_free - ceil(total x u)`` is what
the cache leaves free beyond what it keeps for transient activations; a bank
needs it to hold its bytes and vLLM's margin, by the connector's own fit
(``bank_fit.registration_room``).  Before the engine runs, what vLLM will
keep is not known: what an earlier engine of the same flags kept (vLLM's
"Memory after warmup" lines, ``measured_peak``) or else ``PEAK_ALLOWANCE``
stands for it, and ``NON_TORCH_ALLOWANCE`` for what vLLM allocates outside
torch after its start-up snapshot, which the connector counts against the
bank as if vLLM kept it.
"""
from __future__ import annotations

import gc
import math
import os
import re
from typing import NamedTuple

GiB = 2**30
# The server's worker creates its CUDA context (and NCCL's buffers) before vLLM measures free memory: a
# --gpu-memory-utilization suggested below leaves this much room for them.
SERVER_CONTEXT_BYTES = GiB


def requested_utilization(engine: dict) -> float | None:
    """The fraction of the GPU ``vllm serve`` must find free to start (``engine``:
    the check's engine flags by ``LLM(**kwargs)`` name): the user's
    ``--gpu-memory-utilization``, else vLLM's default.  None where the server
    starts whatever is free: vLLM 0.34's extensible KV cache (CUDA's default
    unless the flags size the cache otherwise) takes its budget as a cap only
    and sizes the cache from the memory free after warmup
    (``vllm/v1/worker/utils.py``: ``request_memory``)."""
    from vllm.config import CacheConfig
    from vllm.engine.arg_utils import EngineArgs

    extensible = "enable_extensible_kv_cache" in EngineArgs.__dataclass_fields__ and not (
        engine.get("enable_extensible_kv_cache") is False or engine.get("kv_cache_memory_bytes") is not None
        or engine.get("num_gpu_blocks_override") is not None or engine.get("enable_elastic_ep"))
    if extensible:
        return None
    if engine.get("gpu_memory_utilization") is not None:
        return float(engine["gpu_memory_utilization"])
    default = EngineArgs.gpu_memory_utilization  # vLLM 0.34 leaves it None: its CacheConfig resolves it
    return float(CacheConfig.DEFAULT_GPU_MEMORY_UTILIZATION if default is None else default)


def release_before_serving(utilization: float | None) -> str | None:
    """Releases what this process holds on its GPU (the collected engines'
    memory, torch's cached blocks); then the line refusing the served step
    when the GPU's free memory is below ``utilization`` x its total (the
    server would not start), naming what this process still holds.  None
    when the server has its room, starts whatever is free (``utilization``
    None: ``requested_utilization``), or CUDA was never initialised here."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    gc.collect()  # engines' last references, in cycles: their tensors back to the allocator
    torch.cuda.empty_cache()  # and the allocator's cached blocks back to the driver
    if utilization is None:
        return None
    held = torch.cuda.memory_reserved()
    free, total = torch.cuda.mem_get_info()
    need = math.ceil(total * utilization)
    if free >= need:
        return None
    rest = max(total - free - held, 0)
    lower = math.floor((free - SERVER_CONTEXT_BYTES) / total * 100) / 100
    ways = ["drop --in-process (each step's engine then runs, and frees the GPU, in a process of its own)"]
    if lower > 0:
        ways.append(f"pass --gpu-memory-utilization {lower:.2f} or lower")
    return (f"vllm serve cannot start beside this --in-process check: it needs --gpu-memory-utilization "
            f"{utilization:g} x {total / GiB:.2f} GiB = {need / GiB:.2f} GiB free on the GPU, and {free / GiB:.2f} "
            f"GiB are free; this process still holds {held / GiB:.2f} GiB after releasing its cached memory (the "
            f"rest, {rest / GiB:.2f} GiB, is CUDA contexts and other processes). " + "; or ".join(ways))



# Before an engine has run, the transient peak vLLM 0.34's extensible KV cache will keep: an allowance whose
# margin (0.75 x 8 GiB) covers the peaks of single-GPU models at vLLM's default batch; a larger peak is
# refused at registration, naming the utilization that fits.
PEAK_ALLOWANCE = 8 * GiB
# What a plan allows for vLLM 0.34's allocations outside torch between its start-up snapshot and its measure
# (kernel scratch, communicators' buffers, lazily loaded modules) and for its cache's rounding down to whole
# blocks: the connector sees both as vLLM's and keeps their margin too.  As much as vLLM's torch cap leaves free
# for such allocations after the measure (KV_CACHE_NON_TORCH_RESERVE_BYTES on CUDA, bank_fit.NON_TORCH_RESERVE).
NON_TORCH_ALLOWANCE = GiB // 2
# Rotary cos/sin tables re-rotation keeps on the GPU, per position below max_model_len: up to two distinct
# float32 tables of up to 256 columns (a model's and a sparse indexer's, or Gemma 3's two layer types' at its
# head size of 256: 128 MiB each at 128k positions).
TABLE_BYTES_PER_POSITION = 2 * 256 * 4
# auto keeps the bank on the GPU where the utilization that makes room for it is at least this (the
# weights and the KV cache keep half the GPU); in host memory otherwise.
AUTO_DEVICE_UTILIZATION = 0.5


class RoomPlan(NamedTuple):
    """What a replay engine is started with: ``utilization`` to pass (None:
    the flags as they are), or ``refused`` with ``line`` naming why and the
    utilization that fits; ``line`` says what was decided either way."""
    utilization: float | None
    line: str
    refused: bool = False


def extensible_kv_cache_on(engine: dict) -> bool:
    """Whether vLLM 0.34's extensible KV cache sizes an engine of these
    flags (by ``LLM(**kwargs)`` name): this vLLM has it, the flags leave it
    on (``requested_utilization``) and a CUDA GPU is visible (vLLM enables
    it on CUDA)."""
    if requested_utilization({**engine, "gpu_memory_utilization": None}) is not None:
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def gpu_memory(count: int = 1) -> tuple[int, int] | None:
    """``(free, total)`` bytes of the visible GPU with the least free memory
    among the first ``count`` (NVML: no CUDA context is created here, where a
    server is about to start); None when NVML cannot say."""
    try:
        from vllm.third_party import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = [i.strip() for i in visible.split(",") if i.strip()] if visible else None
            handles = []
            for k in range(count):
                idx = ids[k] if ids else str(k)
                handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(idx)) if idx.isdigit()
                               else pynvml.nvmlDeviceGetHandleByUUID(idx))
            infos = [pynvml.nvmlDeviceGetMemoryInfo(h) for h in handles]
            return min(int(i.free) for i in infos), min(int(i.total) for i in infos)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML, no such device: nothing decided before the engine
        return None


_WARMUP_LINE = re.compile(r"Memory after warmup: .*?([0-9.]+) GiB kept for transient activations \(([0-9.]+) GiB "
                          r"allocated at peak, ([0-9.]+) GiB of torch reservation growth\)")


def measured_peak(log_text: str) -> int | None:
    """What vLLM 0.34's extensible KV cache kept free for transient
    activations, from its log ("Memory after warmup: ... GiB kept for
    transient activations (... GiB allocated at peak, ... GiB of torch
    reservation growth)", ``extensible_kv_cache.py:693-707``): the first
    figure, ``max(peak, growth)``, which ``measure_kv_cache_bytes`` keeps
    free (the peak alone is short wherever torch's reservation grew more).
    The largest over the lines: a TP server's workers log one each, in any
    order, and the engine commits the smallest cache of its ranks, sized by
    the largest.  Rounded up past the log's 0.01 GiB; None where there is
    no such line."""
    found = _WARMUP_LINE.findall(log_text or "")
    if not found:
        return None
    kept = max(float(line[0]) for line in found)
    return math.ceil((kept + 0.01) * GiB)


def plan_room(placement: str, *, rows: int, states: int, staging: int, tables: int, rotate: bool, free: int,
              total: int, asked: float | None, peak: int | None) -> RoomPlan:
    """The utilization a replay engine under the extensible KV cache starts
    with so that its bank has room (``bank_fit.utilization_for``: the room
    the connector's fit will find at registration), from the GPU's ``free``
    memory now less the server's CUDA context (``SERVER_CONTEXT_BYTES``),
    the bank part's bytes on the GPU where it is kept
    (``bank_fit.device_bytes``), the ``peak`` vLLM will keep for transient
    activations (``measured_peak``; None: ``PEAK_ALLOWANCE``) and
    ``NON_TORCH_ALLOWANCE``.  ``asked``: the user's
    ``--gpu-memory-utilization``, kept where it leaves the room, else
    refused naming the one that does; ``placement``: the bank's
    ``bank_placement`` (auto: the device where that costs no more than
    ``AUTO_DEVICE_UTILIZATION``, else the host)."""
    from kvfill.connector.bank_fit import device_bytes, extensible_margin, utilization_for

    init_free = free - SERVER_CONTEXT_BYTES
    peak_for = PEAK_ALLOWANCE if peak is None else peak
    sizes = dict(rows=rows, states=states, staging=staging, rotate=rotate, tables=tables)
    fits = {where: utilization_for(device_bytes(where, **sizes), init_free=init_free, total=total, peak=peak_for,
                                   non_torch=NON_TORCH_ALLOWANCE) for where in ("device", "host")}
    where = placement
    if placement == "auto":  # the connector keeps the rows on the device where they fit, else on the host
        best = max(("device", "host"), key=lambda w: fits[w] or 0.0)
        if asked is not None:
            where = next((w for w in ("device", "host") if fits[w] is not None and asked <= fits[w]), best)
        else:  # the device where it costs the KV cache little, or no more than the host's staging does
            on_device = fits["device"] is not None and (fits["device"] >= AUTO_DEVICE_UTILIZATION or best == "device")
            where = "device" if on_device else "host"
    u = fits[where]
    need = device_bytes(where, **sizes)
    what = (f"the bank part's {need / GiB:.2f} GiB on the GPU (bank_placement {placement!r}: kept on the {where}) "
            f"beside vLLM 0.34's extensible KV cache, a transient peak of {peak_for / GiB:.2f} GiB "
            f"({'measured' if peak is not None else 'assumed'}) kept free (the larger of the allocated peak and "
            f"torch's reservation growth), {NON_TORCH_ALLOWANCE / GiB:.2f} GiB allowed for allocations outside torch, "
            f"the margin of both ({extensible_margin(peak_for + NON_TORCH_ALLOWANCE) / GiB:.2f} GiB) and "
            f"{free / GiB:.2f} GiB free less {SERVER_CONTEXT_BYTES / GiB:.0f} GiB for the server's context")
    if u is None:
        return RoomPlan(None, f"no --gpu-memory-utilization leaves room for {what}; keep the bank in host memory "
                              f"(bank_placement 'host'), record fewer sequences or positions, or split the bank over "
                              f"more ranks", refused=True)
    if asked is None:
        return RoomPlan(u, f"--gpu-memory-utilization {u:.3f}: room for {what}")
    if asked <= u:
        return RoomPlan(None, f"--gpu-memory-utilization {asked:g} leaves room for {what}")
    return RoomPlan(None, f"--gpu-memory-utilization {asked:g} leaves no room for {what}: pass "
                          f"--gpu-memory-utilization {u:.3f} or lower", refused=True)


def bank_part_bytes(bank: str, *, tp_size: int, max_model_len: int | None) -> tuple[int, int] | None:
    """``(rows, states)`` bytes of the largest rank's part of ``bank`` under
    tensor parallel size ``tp_size`` (every layer: pipeline and decode
    context parallelism are not cut here), from the file's header; None
    where it cannot be read."""
    from kvfill.bank import Bank, BankError, BankPart
    from kvfill.bank.files import layers_info, _read_metadata

    sizes = {}

    def fits(rows: int, states: int) -> str:
        sizes.update(rows=rows, states=states)
        return "sized"  # stops the load before a row is read

    try:
        whole = frozenset(n for n, v in layers_info(_read_metadata(bank), bank).items() if not v.get("kv"))
        Bank.load(bank, BankPart(0, max(1, int(tp_size)), whole_layers=whole, max_positions=max_model_len or None),
                  fits)
    except (BankError, OSError, ValueError):
        pass
    return (sizes["rows"], sizes["states"]) if sizes else None


def replay_room(engine: dict, extra: dict, bank: str, max_model_len: int | None,
                peak: int | None = None) -> RoomPlan | None:
    """``plan_room`` for a replay engine of these flags (by ``LLM(**kwargs)``
    name) and connector keys ``extra``; None where nothing is to be decided
    before it starts: no extensible KV cache, no GPU NVML sees, a bank
    whose header cannot be read (the connector then says)."""
    if not extensible_kv_cache_on(engine):
        return None
    tp = int(engine.get("tensor_parallel_size") or 1)
    memory = gpu_memory(tp)
    sizes = bank_part_bytes(bank, tp_size=tp, max_model_len=max_model_len)
    if memory is None or sizes is None:
        return None
    rotate = extra.get("past_bank") == "rotate"
    tables = TABLE_BYTES_PER_POSITION * int(max_model_len or 0) if rotate else 0
    asked = engine.get("gpu_memory_utilization")
    return plan_room(str(extra.get("bank_placement") or "auto"), rows=sizes[0], states=sizes[1],
                     staging=int(extra.get("staging_mib", 256)) << 20, tables=tables, rotate=rotate,
                     free=memory[0], total=memory[1], asked=None if asked is None else float(asked), peak=peak)
