"""FillEngine: register caches once, then fill plans in O(1) launches.

The engine ties the pieces together, each in its own file:

    registry.py   caches -> layouts -> launch classes (once, at construction)
    backend.py    the backends' interface; one is chosen once, here (``make_backend``):
                  triton_backend.py (GPU) or torch_fill.py (CPU)
    plan.py       the plan format; every plan is validated here before any write
    verify.py     recompute what planned slots must hold and compare bits
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np
import torch

from kvfill.bank import Bank, RowFormat

from . import values as V
from .backend import BACKENDS, FillBackend
from .bank_placement import check_placement
from .capture import check_capture_device, pin, stream_capturing
from .plan import FillPlan, GroupFill
from .registry import CacheGroup, RegisteredGroup, Registry
from .torch_fill import TorchBackend
from .verify import VerifyReport, read_plan, verify_plan


@dataclass(frozen=True)
class FillStats:
    """What one fill call did."""

    entries: int
    slots: int
    bytes: int
    launches: int


class FillEngine:
    """Fills registered paged KV caches with synthetic KV.

    Example::

        k = torch.empty(64, 8, 16, 256, dtype=torch.bfloat16, device="cuda")  # [B, H, N, C]
        eng = FillEngine({"attn": CacheGroup({"layer.0": k})}, mean=0.0, std=1.0, seed=7)
        plan = {"attn": GroupFill(block_ids=[3, 9], slot_start=[5, 0], slot_end=[16, 4], local_base=[0, 16])}
        eng.fill(plan)
        assert eng.verify(plan).ok

    ``values`` (a ``ValueSpec``) or ``mean``/``std``/``seed`` say what is
    written; ``bank`` (a ``Bank``) makes every group not registered as
    ``zero`` replay recorded rows instead: entry i's slots hold the bank rows
    of sequence ``sequence[i]`` at their positions (``bank.py``), and the bank
    is checked against the caches (layers, rows, dtypes) and copied to their
    device once, here (``bank_placement``, ``staging_bytes``, ``past_bank``,
    ``rotary``: ``bank_placement.py``).  ``backend``: ``auto`` (Triton for GPU caches, torch
    for CPU caches), ``triton`` or ``torch``; ``layer_ids``: layer name ->
    index for the value function (default: registration order).
    ``page_image_bytes`` (torch backend): how much memory on the caches'
    device may keep whole pages already written, to copy them for later requests at the same
    positions (``page_images.PageImages``; None: 1 GiB, 0: none).
    """

    def __init__(self, groups: Mapping[str, CacheGroup], *, values: V.ValueSpec | None = None, mean: float = 0.015,
                 std: float = 0.0, seed: int = 0, backend: str = "auto", layer_ids: Mapping[str, int] | None = None,
                 bank: Bank | None = None, page_image_bytes: int | None = None, bank_placement: str = "device",
                 staging_bytes: int | None = None, past_bank: str = "wrap", rotary: Mapping | None = None):
        if page_image_bytes is not None:
            if not _is_int(page_image_bytes) or page_image_bytes < 0:
                raise ValueError(f"page_image_bytes must be an int >= 0 (or None), got {page_image_bytes!r}")
            page_image_bytes = int(page_image_bytes)
        self.values = values if values is not None else V.ValueSpec(mean, std, seed)
        check_placement(bank_placement, staging_bytes, past_bank, rotary)
        self._registry = Registry(groups, self.values, layer_ids or {}, bank, bank_placement, staging_bytes,
                                  rotary if past_bank == "rotate" else None)
        self._backend = make_backend(backend, self._registry, page_image_bytes)
        self._warmed = False

    # ------------------------------------------------------------ questions
    @property
    def backend(self) -> str:
        """``triton`` or ``torch``: the backend chosen at registration."""
        return self._backend.name

    @property
    def device(self) -> torch.device:
        return self._registry.device

    @property
    def groups(self) -> dict[str, RegisteredGroup]:
        return dict(self._registry.groups)

    @property
    def bank_placement(self) -> str | None:
        """Where the bank's rows are: ``device``, ``host`` (``staging.py``), None without a bank."""
        staged = self._registry.staged
        return None if self._registry.bank_table is None else "host" if staged and staged.host else "device"

    @property
    def bank_device_bytes(self) -> tuple[int, int]:
        """``(held, transient)`` device bytes of the bank (``bank_placement.placed_rows``)."""
        return self._registry.bank_device_bytes

    @property
    def num_sequences(self) -> int:
        """The bank's recorded sequences a plan entry may name (1 without a bank)."""
        return self._registry.num_sequences

    @property
    def num_launch_classes(self) -> int:
        return len(self._registry.classes)

    def describe(self) -> str:
        """One line per launch class: group, geometry, dtype, mode, layers;
        then what the backend holds (the torch backend's page images)."""
        held = [self._backend.describe(), self._registry.staged.describe() if self._registry.staged else ""]
        return "\n".join([self._registry.describe(), *(h for h in held if h)])

    def _on_device(self):
        """Make the caches' device current: Triton launches on the current
        device's current stream, where the plan upload must be ordered too."""
        if self.device.type == "cuda":
            return torch.cuda.device(self.device)
        return contextlib.nullcontext()

    # ------------------------------------------------------------ plans
    def whole_plan(self, groups: Iterable[str] | None = None) -> FillPlan:
        """Every block of the given groups (default: all), block b holding the
        rank-local tokens ``[b * slots_per_block, (b + 1) * slots_per_block)``."""
        out = {}
        for g in self._registry.groups if groups is None else groups:
            info = self._registry.group(g)
            ids = np.arange(info.num_blocks, dtype=np.int64)
            out[g] = GroupFill(block_ids=ids, local_base=ids * info.slots_per_block)
        return FillPlan(out)

    # ------------------------------------------------------------ fill
    def fill(self, plan: FillPlan | Mapping[str, GroupFill]) -> FillStats:
        """Fill the planned slots of every layer of the planned groups.

        Stream-ordered on the current stream; no host synchronisation.
        """
        checked = checked_plan(self._registry, plan)
        if not checked:
            return FillStats(0, 0, 0, 0)
        with self._on_device():
            staged = self._registry.staged
            if staged is None:
                launches = self._backend.fill(checked)
            else:  # each chunk's rows staged on the device as it is yielded
                launches = sum(self._backend.fill(part, sequences) for part, sequences in staged.chunks(checked))
        return fill_stats(self._registry, checked, launches)

    def fill_all(self, groups: Iterable[str] | None = None) -> FillStats:
        """Startup fill: every block of every (or the given) group."""
        return self.fill(self.whole_plan(groups))

    def warmup(self, num_positions: int = 0) -> int:
        """Prepare the first fill now, writing nothing to the caches.

        Triton: each class is launched once with one empty entry (slots [0,
        0)), so the JIT compiles at registration instead of in the first step
        that fills.  Torch: the page images (``page_image_bytes``) of the whole
        pages holding positions ``[0, num_positions)`` are written, so the
        first requests' pages are copies too.  Returns the number of launches
        (0 on the torch backend).
        """
        if not _is_int(num_positions) or num_positions < 0:
            raise ValueError(f"num_positions must be an int >= 0, got {num_positions!r}")
        with self._on_device():
            launches = self._backend.warmup(int(num_positions))
        self._warmed = True
        return launches

    def fill_device_entries(self, group: str, entries: torch.Tensor) -> int:
        """Fill from a plan already on the device, without host validation or sync.

        ``entries``: int32 ``[n, 4]`` (block, slot_start, slot_end, local_base)
        or ``[n, 5]`` (and the replay sequence, clamped to the bank's) on the
        engine's device, e.g. built by torch ops inside CUDA graph capture.  Nothing is checked on the host; the kernel skips entries whose
        block id is outside ``[0, num_blocks)`` and clamps slot ranges to the
        block, so a bad entry writes nothing instead of raising.  Triton backend
        only.  Returns the number of launches issued.

        Under CUDA graph capture (``capture.py``) the engine must have been
        warmed up (``warmup()``) - a first launch would load a module - and
        is pinned until ``release_captured_fills()``: the graph reads its
        layer table and bank copy, so dropping the engine must not free them.
        Its caches' GPU must be the current device (else refused): capture
        records the current device's stream only.
        """
        if stream_capturing():
            check_capture_device(self.device)
            if not self._warmed:
                raise RuntimeError(
                    "fill_device_entries under CUDA graph capture needs engine.warmup() before capture "
                    "(a first launch compiles and loads a module, which capture forbids)"
                )
            pin(("engine", id(self)), self)
        with self._on_device():
            return self._backend.fill_device_entries(group, entries)

    # ------------------------------------------------------------ read
    def read(self, plan: FillPlan | Mapping[str, GroupFill],
             layers: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """What the planned slots hold now, per layer ``[num_rows, layer row]``
        in the caches' dtype (``verify.read_plan``): how a bank is recorded.
        ``layers``: only these (None: all; a recorder reads one at a time, so
        a long prompt holds one layer's rows on the device, not all).
        Synchronises with the device."""
        return read_plan(self._registry, checked_plan(self._registry, plan), layers)

    def row_formats(self) -> dict[str, RowFormat]:
        """Layer -> its row's element dims (a bank's ``parts``) and relation to
        a bank's canonical row (``kvfill.bank.RowFormat``)."""
        return self._registry.row_formats()

    def value_dtypes(self) -> dict[str, torch.dtype]:
        """Layer -> the float dtype its bytes encode (layers that hold values;
        a packed row of parts: its storage dtype, each part encodes its own)."""
        return {t.layer: t.row_vdtype for t in self._registry.tensors if t.vdtype is not None}

    # ------------------------------------------------------------ verify
    def verify(self, plan: FillPlan | Mapping[str, GroupFill], *, max_report: int = 8) -> VerifyReport:
        """Recompute what every planned slot must hold and compare bits.

        Synchronises with the device (reads the caches back).
        """
        return verify_plan(self._registry, checked_plan(self._registry, plan), max_report=max_report)


def checked_plan(registry: Registry, plan: FillPlan | Mapping[str, GroupFill]) -> dict[str, GroupFill]:
    """Normalize and validate every group's entries against the registered
    caches (nothing is written on error); drop empty entries and groups."""
    out = {}
    for gname, entries in FillPlan.of(plan).groups.items():
        info = registry.group(gname)
        if not isinstance(entries, GroupFill):
            entries = GroupFill(block_ids=entries)
        entries = entries.normalized(info.slots_per_block)
        entries.validate(gname, num_blocks=info.num_blocks, slots_per_block=info.slots_per_block,
                         num_sequences=registry.num_sequences)
        keep = entries.slot_end > entries.slot_start
        if not keep.all():
            entries = entries.select(keep)
        if entries.num_entries:
            out[gname] = entries
    return out


def fill_stats(registry: Registry, checked: Mapping[str, GroupFill], launches: int) -> FillStats:
    """Entries, slots (over every layer) and bytes a checked plan writes."""
    slots = nbytes = 0
    for c in registry.classes:
        if c.group in checked:
            n = checked[c.group].num_slots * len(c.tensors)
            slots += n
            nbytes += n * c.layout.row_size * c.layout.itemsize
    return FillStats(sum(g.num_entries for g in checked.values()), slots, nbytes, launches)


def make_backend(name: str, registry: Registry, page_image_bytes: int | None = None) -> FillBackend:
    """``auto``: Triton for GPU caches, torch for CPU caches.  ``page_image_bytes``:
    the torch backend's ``PageImages`` budget (None: its default)."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not one of {BACKENDS}")
    on_cpu = registry.device.type == "cpu"
    if name == "auto":
        name = "torch" if on_cpu else "triton"
    if name == "torch":
        return TorchBackend(registry, page_image_bytes)
    if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before kvfill "
            "is imported; use backend 'torch' (or 'auto') for CPU caches"
        )
    from .triton_backend import TritonBackend  # imported late: TRITON_INTERPRET must be set first

    return TritonBackend(registry)


def _is_int(x) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
