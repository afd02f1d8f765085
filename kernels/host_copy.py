"""Host-to-device copies made inside a fill, without a host synchronisation.

On CUDA a copy from pageable host memory, or any copy made without
``non_blocking=True``, is a ``cudaMemcpyAsync`` followed by a stream
synchronisation: the host waits for everything queued before it - in
vLLM's ``pre_forward`` a stall of the async scheduling the fill promises
not to cause.  A copy into a non-contiguous device view is worse: PyTorch
makes a device temporary as large as the copy and adds a device-to-device
pass.  So every upload of a step goes through here: the host tensor pinned
(a host-side copy, no device wait; PyTorch's caching host allocator keeps a
pinned block alive until the copy reading it has run), copied non-blocking,
into a contiguous target.

Where the caches are host memory (vLLM's CPU platform: ``torch.device("cpu")``,
no index) nothing is pinned or copied: the tensor is used as it is.  Any
other device - a GPU, or the tests' accelerator stand-in ``cpu:0``
(``tests/device_rule.py``) - takes the pinned path, so the stand-in sees what
a GPU would do.

Events (``record_event`` / ``wait_event``) mark when a copy out of a reused
pinned buffer has completed: the only host wait a fill makes, and only where
a host-kept bank's fill needs a third chunk (``staging.py``).
"""
from __future__ import annotations

import torch

HOST = torch.device("cpu")


def is_host(device) -> bool:
    """The caches' device is host memory (vLLM CPU): no copies, no pinning."""
    return torch.device(device) == HOST


def upload(host: torch.Tensor, device) -> torch.Tensor:
    """``host`` on ``device``, stream-ordered and without a host wait: pinned
    (unless it is already), then copied non-blocking.  On the host: ``host``."""
    if is_host(device):
        return host
    if not host.is_pinned():
        host = host.contiguous().pin_memory()
    return host.to(device, non_blocking=True)


def pinned_empty(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A flat host buffer for copies to ``device``: pinned unless the caches
    are host memory."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=not is_host(device))


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[i] <- src[i]`` for each leading index, non-blocking: one copy
    where both are contiguous, else one per leading index, each into a
    contiguous slice (never a device temporary)."""
    if dst.is_contiguous() and src.is_contiguous():
        dst.copy_(src, non_blocking=True)
        return
    for d, s in zip(dst, src):
        if not (d.is_contiguous() and s.is_contiguous()):
            raise ValueError(f"copy_rows needs contiguous rows, got strides {d.stride()} <- {s.stride()}")
        d.copy_(s, non_blocking=True)


def record_event(device):
    """An event recorded on the current stream of ``device`` (None where
    there are no streams: the host, the CPU stand-in)."""
    if torch.device(device).type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def wait_event(event) -> None:
    """The host waits for ``event`` (nothing for None)."""
    if event is not None:
        event.synchronize()
