"""FillEngine: register caches once, then fill plans in O(1) launches.

Registration derives every tensor's layout, groups tensors of equal geometry,
dtype and mode into *launch classes* and builds one device table of
``(base address, row key, element offset)`` per layer tensor.  ``fill(plan)``
validates the whole plan on the host, uploads it once (``int32[n, 4]``) and
issues one launch per class with planned entries: the launch count depends on
neither the number of layers nor the number of requests.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from . import values as V
from .layout import Layout, layout_of
from .plan import FillPlan, GroupFill, validate_entries
from .torch_fill import SlotRows, expected_rows, fill_rows, read_rows

BACKENDS = ("auto", "triton", "torch")


@dataclass
class CacheGroup:
    """One KV cache group: layers sharing a block table.

    layers: layer name -> cache tensor, or a list/tuple of state tensors
        (Mamba/KDA: each block-indexed on ``block_dim``, no slot dim).
    num_blocks: the manager's block count; a tensor with ``num_blocks * r``
        entries on ``block_dim`` is kernel-block granular.  None: taken from
        the tensors (the smallest block count).
    block_dim / slot_dim: as in ``layout_of``; lists of state tensors have no
        slot dim whatever ``slot_dim`` says.
    encoding: ``auto`` / ``native`` / ``fp8_e4m3`` / ``fp8_e5m2`` / ``packed``
        for every tensor of the group, or a mapping layer name -> encoding.
    mode: None (the engine's: normal if std > 0 else constant) or ``zero``
        (circular buffers, int metadata).
    dcp_world_size / dcp_rank / interleave: this group's DCP geometry (W, r, I).
    """

    layers: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]
    num_blocks: int | None = None
    block_dim: int = 0
    slot_dim: int | None | str = "auto"
    encoding: str | Mapping[str, str] = V.ENC_AUTO
    mode: str | None = None
    dcp_world_size: int = 1
    dcp_rank: int = 0
    interleave: int = 1


@dataclass(frozen=True)
class _Target:
    """One registered tensor of one layer."""

    group: str
    layer: str
    sub: int | None           # index in a state-tensor list, None for plain caches
    tensor: torch.Tensor
    layout: Layout
    vdtype: torch.dtype | None
    mode: str
    key: int
    elem_offset: int


@dataclass
class _LaunchClass:
    group: str
    layout: Layout
    vdtype: torch.dtype | None
    mode: str
    targets: list[_Target] = field(default_factory=list)
    layer_rows: slice = field(default_factory=lambda: slice(0, 0))
    ref: torch.Tensor | None = None  # lowest-addressed tensor, as bits (Triton)
    layer_align: int = 1             # power of two dividing every layer offset


@dataclass
class _GroupInfo:
    name: str
    block_size: int
    num_blocks: int
    dcp: tuple[int, int, int]  # (W, r, I)


@dataclass(frozen=True)
class FillStats:
    """What one fill call did."""

    entries: int
    slots: int
    bytes: int
    launches: int


@dataclass(frozen=True)
class Mismatch:
    layer: str
    sub: int | None
    block: int
    slot: int
    element: int
    expected: float
    found: float


@dataclass(frozen=True)
class VerifyReport:
    ok: bool
    num_checked: int
    num_mismatched: int
    first: tuple[Mismatch, ...]

    def __bool__(self) -> bool:
        return self.ok


def _check_scalar(name: str, value, *, minimum=None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


class FillEngine:
    """Fills registered paged KV caches with synthetic KV.

    Example::

        k = torch.empty(64, 8, 16, 256, dtype=torch.bfloat16, device="cuda")  # [B, H, N, C]
        eng = FillEngine({"attn": CacheGroup({"layer.0": k})}, mean=0.0, std=1.0, seed=7)
        eng.fill({"attn": GroupFill(block_ids=[3, 9], slot_start=[5, 0], slot_end=[16, 4],
                                    local_base=[0, 16])})
        assert eng.verify({"attn": GroupFill(block_ids=[3, 9], ...)}).ok
    """

    def __init__(
        self,
        groups: Mapping[str, CacheGroup],
        *,
        mean: float = 0.015,
        std: float = 0.0,
        seed: int = 0,
        backend: str = "auto",
        layer_ids: Mapping[str, int] | None = None,
    ):
        _check_scalar("mean", mean)
        _check_scalar("std", std, minimum=0.0)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
        self.mean, self.std, self.seed = float(mean), float(std), seed
        self._groups: dict[str, _GroupInfo] = {}
        self._targets: list[_Target] = []
        self._register(groups, layer_ids or {})
        devices = {t.tensor.device for t in self._targets}
        if len(devices) > 1:
            raise ValueError(f"all caches must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.backend = self._resolve_backend(backend)
        self._classes = self._build_classes()
        self.launches = 0  # kernel launches issued so far (Triton backend)

    # ------------------------------------------------------------ registration
    def _register(self, groups: Mapping[str, CacheGroup], layer_ids: Mapping[str, int]) -> None:
        next_id = 0
        seen: set[str] = set()
        for gname, g in groups.items():
            if not isinstance(g, CacheGroup):
                raise TypeError(f"group {gname!r}: expected a CacheGroup, got {type(g).__name__}")
            W, r, I = g.dcp_world_size, g.dcp_rank, g.interleave
            if not (isinstance(W, int) and W >= 1 and isinstance(I, int) and I >= 1 and 0 <= r < W):
                raise ValueError(
                    f"group {gname!r}: DCP geometry world_size={W}, rank={r}, interleave={I} "
                    "is invalid; expected world_size >= 1, 0 <= rank < world_size, interleave >= 1"
                )
            targets: list[_Target] = []
            for lname, caches in g.layers.items():
                if lname in seen:
                    raise ValueError(f"layer {lname!r} is registered in more than one group")
                seen.add(lname)
                lid = layer_ids.get(lname, next_id)
                next_id = max(next_id, lid + 1)
                enc = g.encoding.get(lname, V.ENC_AUTO) if isinstance(g.encoding, Mapping) else g.encoding
                is_list = isinstance(caches, (list, tuple))
                tensors = list(caches) if is_list else [caches]
                elem_offset = 0
                for sub, t in enumerate(tensors):
                    where = f"group {gname!r} layer {lname!r}" + (f" state tensor {sub}" if is_list else "")
                    try:
                        layout = layout_of(
                            t,
                            block_dim=g.block_dim,
                            slot_dim=None if is_list else g.slot_dim,
                            num_blocks=g.num_blocks,
                        )
                        vdtype = V.value_dtype(t.dtype, enc)
                    except (ValueError, TypeError) as exc:
                        raise type(exc)(f"{where}: {exc}") from None
                    mode = V.ZERO if vdtype is None else V.resolve_mode(self.std, g.mode)
                    targets.append(
                        _Target(
                            group=gname,
                            layer=lname,
                            sub=sub if is_list else None,
                            tensor=t,
                            layout=layout,
                            vdtype=vdtype,
                            mode=mode,
                            key=V.layer_key(self.seed, lid),
                            elem_offset=elem_offset,
                        )
                    )
                    elem_offset += layout.row_size
            sizes = {t.layout.block_size for t in targets}
            if len(sizes) > 1:
                raise ValueError(
                    f"group {gname!r}: layers disagree on the block size (slots per block): "
                    f"{sorted(sizes)}; a group shares one block table"
                )
            bs = sizes.pop() if sizes else 1
            if W > 1 and bs % I:
                raise ValueError(
                    f"group {gname!r}: interleave {I} does not divide the block size {bs}"
                )
            nb = g.num_blocks if g.num_blocks is not None else min(
                (t.layout.num_blocks for t in targets), default=0
            )
            self._groups[gname] = _GroupInfo(gname, bs, nb, (W, r, I))
            self._targets.extend(targets)

    def _resolve_backend(self, backend: str) -> str:
        if backend == "auto":
            return "torch" if self.device.type == "cpu" else "triton"
        if backend == "triton" and self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before kvfill "
                "is imported; use backend 'torch' (or 'auto') for CPU caches"
            )
        return backend

    def _build_classes(self) -> list[_LaunchClass]:
        classes: dict[tuple, _LaunchClass] = {}
        for t in self._targets:
            k = (t.group, t.layout, t.vdtype, t.mode)
            if k not in classes:
                classes[k] = _LaunchClass(t.group, t.layout, t.vdtype, t.mode)
            classes[k].targets.append(t)
        out = list(classes.values())
        rows: list[tuple[int, int, int]] = []
        for c in out:
            c.layer_rows = slice(len(rows), len(rows) + len(c.targets))
            itemsize = c.layout.itemsize
            ref = min(c.targets, key=lambda t: t.tensor.data_ptr())
            c.ref = ref.tensor.view(V.BITS_DTYPE[itemsize])
            offsets = []
            for t in c.targets:
                delta = t.tensor.data_ptr() - ref.tensor.data_ptr()
                if delta % itemsize:
                    raise ValueError(
                        f"layer {t.layer!r} starts {delta} bytes after layer {ref.layer!r}, not a "
                        f"multiple of its {itemsize}-byte elements; cannot address both in one launch"
                    )
                offsets.append(delta // itemsize)
            # Largest power of two (<= 16 bytes) dividing every offset.
            align = 16 // itemsize
            while align > 1 and any(o % align for o in offsets):
                align //= 2
            c.layer_align = align
            rows.extend((o, t.key, t.elem_offset) for o, t in zip(offsets, c.targets))
        self._layer_table = None
        if self.backend == "triton":
            self._layer_table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).to(self.device)
        max_row: dict[tuple, int] = {}
        for c in out:
            k = (c.mode, c.vdtype, c.layout.itemsize)
            max_row[k] = max(max_row.get(k, 1), c.layout.row_size)
        self._tables = {
            k: V.value_table(k[0], self.mean, self.std, k[1], k[2], self.device, max_row=row)
            for k, row in max_row.items()
        }
        return out

    # ------------------------------------------------------------ questions
    @property
    def groups(self) -> dict[str, _GroupInfo]:
        return dict(self._groups)

    @property
    def num_launch_classes(self) -> int:
        return len(self._classes)

    def describe(self) -> str:
        """One line per launch class: group, geometry, dtype, mode, layers."""
        lines = []
        for c in self._classes:
            lay = c.layout
            lines.append(
                f"{c.group}: {len(c.targets)} tensor(s) x {lay.num_blocks} blocks x "
                f"{lay.block_size} slots x {lay.row_size} elems of {lay.itemsize} B "
                f"[{c.vdtype or 'packed'}, {c.mode}]"
            )
        return "\n".join(lines)

    # ------------------------------------------------------------ plans
    def _expand(self, plan) -> dict[str, tuple[np.ndarray, ...]]:
        """Validate every group's entries (nothing is written on error)."""
        plan = FillPlan.of(plan)
        out = {}
        for gname, gf in plan.groups.items():
            info = self._groups.get(gname)
            if info is None:
                raise ValueError(
                    f"plan names group {gname!r}, which is not registered; "
                    f"registered groups: {sorted(self._groups)}"
                )
            if not isinstance(gf, GroupFill):
                gf = GroupFill(block_ids=gf)
            arrays = gf.arrays(info.block_size)
            validate_entries(gname, *arrays, num_blocks=info.num_blocks, block_size=info.block_size)
            keep = arrays[2] > arrays[1]
            if not keep.all():
                arrays = tuple(a[keep] for a in arrays)
            if arrays[0].size:
                out[gname] = arrays
        return out

    def whole_plan(self, groups: Iterable[str] | None = None) -> FillPlan:
        """Every block of the given groups (default: all), block b holding tokens
        ``[b * block_size, (b + 1) * block_size)`` of a rank-local sequence."""
        names = list(self._groups) if groups is None else list(groups)
        out = {}
        for g in names:
            info = self._groups.get(g)
            if info is None:
                raise ValueError(f"group {g!r} is not registered; registered: {sorted(self._groups)}")
            ids = np.arange(info.num_blocks, dtype=np.int64)
            out[g] = GroupFill(block_ids=ids, local_base=ids * info.block_size)
        return FillPlan(out)

    # ------------------------------------------------------------ fill
    def fill(self, plan: FillPlan | Mapping[str, GroupFill]) -> FillStats:
        """Fill the planned slots of every layer of the planned groups.

        Stream-ordered on the current stream; no host synchronisation.
        """
        expanded = self._expand(plan)
        if not expanded:
            return FillStats(0, 0, 0, 0)
        stats = {"entries": 0, "slots": 0, "bytes": 0, "launches": 0}
        for arrays in expanded.values():
            stats["entries"] += int(arrays[0].size)
        if self.backend == "triton":
            self._fill_triton(expanded, stats)
        else:
            self._fill_torch(expanded, stats)
        return FillStats(**stats)

    def fill_all(self, groups: Iterable[str] | None = None) -> FillStats:
        """Startup fill: every block of every (or the given) group."""
        return self.fill(self.whole_plan(groups))

    def warmup(self) -> int:
        """Compile every launch class's kernel now, writing nothing.

        Each class is launched once with one empty entry (slots [0, 0)), so the
        Triton JIT compiles at registration instead of in the first step that
        fills.  Returns the number of launches (0 on the torch backend).
        """
        if self.backend != "triton":
            return 0
        empty = torch.zeros(1, 4, dtype=torch.int32, device=self.device)
        for c in self._classes:
            self._launch(c, empty)
        return len(self._classes)

    def fill_device_entries(self, group: str, entries: torch.Tensor) -> int:
        """Fill from a plan already on the device, without host validation or sync.

        ``entries``: int32 ``[n, 4]`` (block, slot_start, slot_end, local_base)
        on the engine's device, e.g. built by torch ops inside CUDA graph
        capture.  Nothing is checked on the host; the kernel skips entries whose
        block id is outside ``[0, num_blocks)`` and clamps slot ranges to the
        block, so a bad entry writes nothing instead of raising.  Triton backend
        only.  Returns the number of launches issued.
        """
        if self.backend != "triton":
            raise ValueError(f"fill_device_entries needs the triton backend, this engine uses {self.backend!r}")
        info = self._groups.get(group)
        if info is None:
            raise ValueError(f"group {group!r} is not registered; registered: {sorted(self._groups)}")
        if entries.dtype != torch.int32 or entries.dim() != 2 or entries.shape[1] != 4:
            raise ValueError(f"entries must be int32 [n, 4], got {entries.dtype} {tuple(entries.shape)}")
        if not entries.is_contiguous():  # the kernel reads entry i at offset 4 * i
            raise ValueError(f"entries must be contiguous, got strides {entries.stride()}")
        if entries.device != self.device:
            raise ValueError(f"entries are on {entries.device}, the caches on {self.device}")
        launches = 0
        for c in self._classes:
            if c.group == group:
                self._launch(c, entries)
                launches += 1
        return launches

    def _launch(self, c: _LaunchClass, entries: torch.Tensor) -> None:
        from . import triton_fill

        triton_fill.launch_fill(
            entries,
            self._layer_table[c.layer_rows],
            c.ref,
            c.layer_align,
            self._tables[(c.mode, c.vdtype, c.layout.itemsize)],
            c.layout,
            c.mode,
            self._groups[c.group].dcp,
        )
        self.launches += 1

    @staticmethod
    def _count(stats: dict, layout: Layout, slots: int, tensors: int) -> None:
        stats["slots"] += slots * tensors
        stats["bytes"] += slots * layout.row_size * layout.itemsize * tensors

    def _fill_triton(self, expanded: dict, stats: dict) -> None:
        # One upload of the whole plan: int32 [n, 4], pinned when the target is a GPU.
        order = list(expanded)
        host = np.concatenate([np.stack(expanded[g], axis=1) for g in order]).astype(np.int32)
        host_t = torch.from_numpy(host)
        if self.device.type == "cuda":
            host_t = host_t.pin_memory()
        entries = host_t.to(self.device, non_blocking=True)
        offsets, pos = {}, 0
        for g in order:
            n = expanded[g][0].size
            offsets[g] = (pos, pos + n)
            pos += n
        for c in self._classes:
            if c.group not in offsets:
                continue
            lo, hi = offsets[c.group]
            self._launch(c, entries[lo:hi])
            stats["launches"] += 1
            slots = int((expanded[c.group][2] - expanded[c.group][1]).sum())
            self._count(stats, c.layout, slots, len(c.targets))

    def _slot_rows(self, expanded: dict) -> dict[str, SlotRows]:
        return {g: SlotRows(*arrays, self._groups[g].dcp) for g, arrays in expanded.items()}

    def _planned_classes(self, expanded: dict):
        """Yield (class, its group's slot rows, value table) for planned groups."""
        rows = self._slot_rows(expanded)
        for c in self._classes:
            if c.group in rows:
                yield c, rows[c.group], self._tables[(c.mode, c.vdtype, c.layout.itemsize)]

    def _fill_torch(self, expanded: dict, stats: dict) -> None:
        for c, r, table in self._planned_classes(expanded):
            for t in c.targets:
                fill_rows(t.tensor, c.layout, r, c.mode, table, t.key, t.elem_offset)
            self._count(stats, c.layout, r.num_rows, len(c.targets))

    # ------------------------------------------------------------ verify
    def verify(self, plan: FillPlan | Mapping[str, GroupFill], *, max_report: int = 8) -> VerifyReport:
        """Recompute what every planned slot must hold and compare bits.

        Synchronises with the device (reads the caches back).
        """
        checked = mismatched = 0
        first: list[Mismatch] = []
        for c, r, t, table in (
            (c, r, t, table) for c, r, table in self._planned_classes(self._expand(plan)) for t in c.targets
        ):
            want = expected_rows(r, c.layout, c.mode, table, t.key, t.elem_offset)
            got = read_rows(t.tensor, c.layout, r)
            want = want.expand_as(got)
            bad = got != want
            n_bad = int(bad.sum())
            checked += got.numel()
            mismatched += n_bad
            for ri, e in bad.nonzero()[: max(0, max_report - len(first))].tolist():
                first.append(
                    Mismatch(
                        layer=t.layer,
                        sub=t.sub,
                        block=int(r.block[ri]),
                        slot=int(r.slot[ri]),
                        element=e,
                        expected=_decode(want[ri, e], c.vdtype),
                        found=_decode(got[ri, e], c.vdtype),
                    )
                )
        return VerifyReport(mismatched == 0, checked, mismatched, tuple(first))


def _decode(bits: torch.Tensor, vdtype: torch.dtype | None) -> float:
    if vdtype is None:
        return float(bits.item())
    return float(bits.reshape(1).view(vdtype).float().item())
