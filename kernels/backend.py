"""The one interface both fill backends implement (``FillBackend``) and the
backend names an engine accepts (``BACKENDS``): ``triton``
(``triton_backend.TritonBackend``) for GPU caches, ``torch``
(``torch_fill.TorchBackend``) for CPU caches; both store identical bytes.
The choice is made once, when the engine registers its caches
(``engine.make_backend``); this module imports neither backend.
"""
from __future__ import annotations

import abc
from typing import Mapping

import numpy as np
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
    def fill(self, plan: Mapping[str, GroupFill], sequences: np.ndarray | None = None) -> int:
        """Write every planned slot of every tensor of the planned groups.

        ``plan``: normalized, validated, non-empty entries per registered
        group.  ``sequences``: replay's int64 ``[S, 2]`` (first row, length)
        the entries' sequences name, when not the bank's (a staged fill:
        ``staging.py``).  Stream-ordered, no host sync.  Returns the
        kernel launches issued.
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

