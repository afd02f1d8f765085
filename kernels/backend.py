"""The one interface both fill backends implement, and the choice between them.

A backend is chosen once, when the engine registers its caches:
``triton`` (``triton_fill.TritonBackend``) for GPU caches, ``torch``
(``torch_fill.TorchBackend``) for CPU caches; both store identical bytes.
"""
from __future__ import annotations

import abc
import os
from typing import Mapping

import torch

from .plan import GroupFill
from .registry import Registry

BACKENDS = ("auto", "triton", "torch")


class FillBackend(abc.ABC):
    """Writes validated, normalized plans into a registry's caches."""

    name: str

    def __init__(self, registry: Registry):
        self.registry = registry

    @abc.abstractmethod
    def fill(self, plan: Mapping[str, GroupFill]) -> int:
        """Write every planned slot of every tensor of the planned groups.

        ``plan``: normalized, validated, non-empty entries per registered
        group.  Stream-ordered, no host sync.  Returns the kernel launches issued.
        """

    def warmup(self, num_positions: int = 0) -> int:
        """Compile what the first fill would compile; write nothing to the
        caches (the torch backend writes its page images of positions
        ``[0, num_positions)``).  Returns launches."""
        return 0

    def describe(self) -> str:
        """What the backend holds besides the caches ("" if nothing)."""
        return ""

    def fill_device_entries(self, group: str, entries: torch.Tensor) -> int:
        raise ValueError(f"fill_device_entries needs the triton backend, this engine uses {self.name!r}")


def make_backend(name: str, registry: Registry, page_image_bytes: int | None = None) -> FillBackend:
    """``auto``: Triton for GPU caches, torch for CPU caches.  ``page_image_bytes``:
    the torch backend's ``PageImages`` budget (None: its default)."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {BACKENDS}")
    on_cpu = registry.device.type == "cpu"
    if name == "auto":
        name = "torch" if on_cpu else "triton"
    if name == "torch":
        from .torch_fill import TorchBackend

        return TorchBackend(registry, page_image_bytes)
    if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before kvfill "
            "is imported; use backend 'torch' (or 'auto') for CPU caches"
        )
    from .triton_fill import TritonBackend  # imported late: TRITON_INTERPRET must be set first

    return TritonBackend(registry)
