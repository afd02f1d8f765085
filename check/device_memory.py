"""The GPU memory an ``--in-process`` check holds when ``--serve`` starts a
server: released first, then weighed against what ``vllm serve`` asks.

A ``vllm serve`` worker refuses to start unless the GPU's free memory is at
least ``--gpu-memory-utilization`` x its total (vLLM's ``request_memory``,
measured after the worker's own CUDA context exists).  With ``--in-process``
the check's earlier engines ran here: their tensors go back to torch's
caching allocator once collected, which keeps them from every other process
until ``torch.cuda.empty_cache()``.  Where CUDA was never initialised here
(vLLM CPU, or steps in processes of their own) nothing is done.
"""
from __future__ import annotations

import gc
import math

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
