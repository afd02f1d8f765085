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


def requested_utilization(engine: dict) -> float:
    """The server's ``--gpu-memory-utilization``: the user's (``engine``: the
    check's engine flags by ``LLM(**kwargs)`` name), else vLLM's default."""
    if "gpu_memory_utilization" in engine:
        return float(engine["gpu_memory_utilization"])
    from vllm.engine.arg_utils import EngineArgs

    return float(EngineArgs.gpu_memory_utilization)


def release_before_serving(utilization: float) -> str | None:
    """Releases what this process holds on its GPU (the collected engines'
    memory, torch's cached blocks); then the line refusing the served step
    when the GPU's free memory is below ``utilization`` x its total (the
    server would not start), naming what this process still holds.  None
    when the server has its room, or CUDA was never initialised here."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    gc.collect()  # engines' last references, in cycles: their tensors back to the allocator
    torch.cuda.empty_cache()  # and the allocator's cached blocks back to the driver
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
