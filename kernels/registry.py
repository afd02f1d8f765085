"""Registration: cache tensors -> layouts -> launch classes, done once.

Every registered tensor gets its layout (``layout.py``), the dtype its bytes
encode and its mode.  Tensors of one group with equal layout, dtype and mode
form a *launch class*: one kernel launch (or one torch pass) fills all of
them.  Nothing here depends on the backend that will do the writes.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np
import torch

from kvfill.bank import NO_DCP, Bank, BankError, BankPart, DcpGeometry, RowFormat

from . import values as V
from .bank_placement import placed_rows
from .rotary import Rerotation
from .staging import HostRows, Staging, padded
from .value_tables import value_table
from .layout import Layout, default_slot_dim, layout_of


def _logical_elem_dims(t: torch.Tensor, block_dim: int, slot_dim) -> tuple[int, ...]:
    nd = t.dim()
    block_dim %= nd
    if slot_dim == "auto":
        slot_dim = default_slot_dim(nd, block_dim)
    skip = {block_dim} | ({slot_dim % nd} if slot_dim is not None else set())
    return tuple(t.shape[d] for d in range(nd) if d not in skip and t.shape[d] > 1)


class RowParts(tuple):
    """Tensors that hold one layer's token row between them, each with a slot
    dim addressed by the group's ``block_dim`` / ``slot_dim`` - e.g. vLLM
    CPU's K and V, which one buffer interleaves in different orders.  The
    layer's row is the parts' rows one after another.  (A plain list or tuple
    of tensors is recurrent state: no slot dim.)"""


def _parts_of(enc, caches, where: str) -> tuple[V.PartValues, ...] | None:
    """A layer's per-part encodings (None: one encoding for all its tensors),
    checked against its tensors: one per tensor of its ``RowParts``."""
    if not isinstance(enc, (tuple, list)):
        return None
    if not isinstance(caches, RowParts) or len(caches) != len(enc) or not all(
            isinstance(p, V.PartValues) for p in enc):
        raise ValueError(f"{where}: per-part encodings {enc!r} need a RowParts of as many tensors, one "
                         f"values.PartValues each; got {type(caches).__name__} of "
                         f"{len(caches) if isinstance(caches, (list, tuple)) else 1}")
    return tuple(enc)


@dataclass
class CacheGroup:
    """One KV cache group: layers sharing a block table.

    layers: layer name -> cache tensor, a list/tuple of state tensors
        (Mamba/KDA: each block-indexed on ``block_dim``, no slot dim), or
        ``RowParts`` (tensors with slot dims sharing the layer's row).
    num_blocks: the manager's block count; a tensor with ``num_blocks * r``
        entries on ``block_dim`` is kernel-block granular.  None: taken from
        the tensors (the smallest block count).
    block_dim / slot_dim: as in ``layout_of``; lists of state tensors have no
        slot dim whatever ``slot_dim`` says.
    encoding: ``auto`` / ``native`` / ``fp8_e4m3`` / ``fp8_e5m2`` / ``packed``
        for every tensor of the group, or a mapping layer name -> encoding,
        or -> a tuple of ``values.PartValues``, one per tensor of the
        layer's ``RowParts``: a packed row whose parts encode values each
        their own way (``packed_rows.py``: DeepSeek's fp8 rows with scales).
    mode: None (the engine's: ``replay`` with a bank, else normal if std > 0,
        else constant) or ``zero`` (circular buffers, int metadata, recurrent
        state under replay).
    dcp: this group's DCP geometry on this rank.
    kv: layer name -> ``(num_kv_heads, head_size, head_size_v)`` of its K/V
        (or one tuple for every layer): how a bank's canonical rows map onto
        the cache's element order (``kvfill/bank/rows.py``).  None: inferred from the
        cache's view where it names them (K and V tensors, ``[2, H, D]``, MLA).
    """

    layers: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]
    num_blocks: int | None = None
    block_dim: int = 0
    slot_dim: int | None | str = "auto"
    encoding: str | Mapping[str, str] = V.ENC_AUTO
    mode: str | None = None
    dcp: DcpGeometry = NO_DCP
    kv: Mapping[str, tuple[int, int, int]] | tuple[int, int, int] | None = None

    def kv_of(self, layer: str) -> tuple[int, int, int] | None:
        """The K/V geometry given for ``layer`` (None: inferred from its view)."""
        return self.kv.get(layer) if isinstance(self.kv, Mapping) else self.kv


@dataclass(frozen=True)
class RegisteredGroup:
    """A group as registered: what a plan for it is checked against."""

    name: str
    slots_per_block: int
    num_blocks: int
    dcp: DcpGeometry


@dataclass(frozen=True)
class LayerTensor:
    """One registered tensor of one layer."""

    group: str
    layer: str
    sub: int | None           # index in a state-tensor list, None for plain caches
    tensor: torch.Tensor
    layout: Layout
    vdtype: torch.dtype | None  # the float dtype its bytes encode; None: zero-filled
    mode: str
    key: int                  # the layer's 32-bit key of the value function
    elem_offset: int          # element index of this tensor's row 0 within the layer's row
    bank: torch.Tensor | None = None  # replay: the layer's bank rows [T, layer row] as bits, on the device
    # (placement "host": the layer's device staging; re-rotating: its rows, then its staging)
    host: HostRows | None = None  # placement "host": the layer's bank rows in host memory
    rerotate: Rerotation | None = None  # past_bank "rotate": how its keys are turned past a sequence's end
    elem_dims: tuple[int, ...] = ()  # the logical element dims (size > 1, not merged): what its row order means
    part: V.PartValues | None = None  # a part of a packed row: how its bytes encode values

    @property
    def row_vdtype(self) -> torch.dtype | None:
        """What a bank row of its layer holds: the values' dtype, or for a
        packed row of parts its raw storage (each part encodes its own)."""
        return self.tensor.dtype if self.part is not None and self.vdtype is not None else self.vdtype


@dataclass
class LaunchClass:
    """Tensors of one group with one layout, dtype and mode (and, replaying,
    bank row size): filled together."""

    group: str
    layout: Layout
    vdtype: torch.dtype | None
    mode: str
    bank_row: int = 0         # replay: elements per bank row of its layers (0 otherwise)
    sequences: np.ndarray | None = None  # replay: the bank's int64 [S, 2] (first row, length)
    tensors: list[LayerTensor] = field(default_factory=list)
    table: torch.Tensor | None = None  # value bits on the device (value_tables.value_table); None: replay
    part: V.PartValues | None = None  # a part of a packed row (its own value table; not in replay)


class Registry:
    """The registered caches of an engine, grouped into launch classes."""

    def __init__(self, groups: Mapping[str, CacheGroup], values: V.ValueSpec, layer_ids: Mapping[str, int],
                 bank: Bank | None = None, bank_placement: str = "device", staging_bytes: int | None = None,
                 rotary: Mapping | None = None):
        self.values = values
        # The mode of a tensor whose group names none.
        self.default_mode = V.REPLAY if bank is not None else values.mode
        self.num_sequences = bank.num_sequences if bank is not None else 1
        # replay: int64 [S, 2] per sequence (first row, length) on the caches' device
        self.bank_sequences: torch.Tensor | None = None
        self.bank_table: np.ndarray | None = None
        self.staged: Staging | None = None  # rows a fill stages (a host-kept bank's; re-rotated keys)
        self.bank_device_bytes = (0, 0)  # (held, transient) the bank's placement counted on the device
        self.kv: dict[str, tuple[int, int, int] | None] = {}  # layer -> the geometry its group gave
        self.groups: dict[str, RegisteredGroup] = {}
        self.tensors: list[LayerTensor] = []
        next_id = 0
        for gname, g in groups.items():
            if not isinstance(g, CacheGroup):
                raise TypeError(f"group {gname!r}: expected a CacheGroup, got {type(g).__name__}")
            if g.mode is not None and g.mode not in V.MODES:
                raise ValueError(f"group {gname!r}: mode {g.mode!r} is not one of {V.MODES}")
            if g.mode == V.REPLAY and bank is None:
                raise ValueError(f"group {gname!r}: mode 'replay' needs a bank (FillEngine(..., bank=...))")
            tensors, next_id = self._register_layers(gname, g, layer_ids, next_id)
            self.groups[gname] = self._group_info(gname, g, tensors)
            self.tensors.extend(tensors)
        devices = {t.tensor.device for t in self.tensors}
        if len(devices) > 1:
            raise ValueError(f"all caches must be on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        if bank is not None:
            # The rows live on in each tensor's device copy (placement "device": the host
            # bank, a second copy when the caches are on a GPU, is not kept) or in the staged bank.
            bank = self._rank_positions(bank)
            self.tensors, self.staged, self.bank_device_bytes = placed_rows(self, bank, bank_placement,
                                                                            staging_bytes, rotary)
            self.bank_table = bank.sequence_table()
            # a staged bank's fills name staged sequences (staging.py): warmup launches as they do
            launched = (self.bank_table if self.staged is None else
                        padded(self.bank_table if self.staged.on_device else np.zeros((0, 2), np.int64)))
            self.bank_sequences = torch.from_numpy(launched).to(self.device)
        self.classes = self._launch_classes()

    def _register_layers(self, gname, g: CacheGroup, layer_ids, next_id) -> tuple[list[LayerTensor], int]:
        seen = {t.layer for t in self.tensors}
        out: list[LayerTensor] = []
        for lname, caches in g.layers.items():
            if lname in seen:
                raise ValueError(f"layer {lname!r} is registered in more than one group")
            seen.add(lname)
            self.kv[lname] = g.kv_of(lname)
            lid = layer_ids.get(lname, next_id)
            next_id = max(next_id, lid + 1)
            enc = g.encoding.get(lname, V.ENC_AUTO) if isinstance(g.encoding, Mapping) else g.encoding
            is_list = isinstance(caches, (list, tuple))
            state = is_list and not isinstance(caches, RowParts)
            parts = _parts_of(enc, caches, f"group {gname!r} layer {lname!r}")
            elem_offset = 0
            for sub, t in enumerate(list(caches) if is_list else [caches]):
                where = f"group {gname!r} layer {lname!r}" + (f" tensor {sub}" if is_list else "")
                part = parts[sub] if parts else None
                try:
                    layout = layout_of(t, block_dim=g.block_dim, slot_dim=None if state else g.slot_dim,
                                       num_blocks=g.num_blocks)
                    if part is not None:
                        ratio = part.storage_ratio(t.dtype)
                        if layout.row_size % ratio:
                            raise ValueError(f"a row of {layout.row_size} elements is no whole number of "
                                             f"{part.vdtype} values")
                    vdtype = part.vdtype if part is not None else V.value_dtype(t.dtype, enc)
                except (ValueError, TypeError) as exc:
                    raise type(exc)(f"{where}: {exc}") from None
                mode = V.ZERO if vdtype is None else (g.mode or self.default_mode)
                if part is not None and mode in (V.CONSTANT, V.NORMAL):
                    mode = V.NORMAL  # its table is read as the normal mode's (value_tables.part_host_table)
                out.append(LayerTensor(gname, lname, sub if is_list else None, t, layout, vdtype, mode,
                                       V.layer_key(self.values.seed, lid), elem_offset,
                                       elem_dims=_logical_elem_dims(t, g.block_dim, None if state else g.slot_dim),
                                       part=part))
                elem_offset += layout.row_size
        return out, next_id

    def _rank_positions(self, bank: Bank) -> Bank:
        """The bank holding this rank's DCP positions (``kvfill/bank/parts.py``): as
        loaded, or selected here from a whole bank."""
        dcps = {self.groups[t.group].dcp for t in self.tensors if t.mode == V.REPLAY}
        dcps = {d if d.sharded else NO_DCP for d in dcps} or {NO_DCP}
        if len(dcps) > 1:
            raise ValueError(f"replaying groups have different DCP geometries {sorted(map(str, dcps))}; one "
                             f"bank serves one geometry")
        dcp = dcps.pop()
        have = bank.part.dcp if bank.part.dcp.sharded else NO_DCP
        if have == dcp:
            return bank
        if bank.part.whole:
            return bank.select(BankPart(dcp=dcp))
        raise BankError(f"{bank.source}: loaded for {bank.part.describe()}, the caches are DCP rank {dcp.rank} of "
                        f"{dcp.world_size} (interleave {dcp.interleave}); load the part of these caches' rank")

    def row_formats(self) -> dict[str, RowFormat]:
        """Layer -> how its cache row relates to a bank's (``kvfill/bank/rows.py``):
        its parts, its K/V geometry (given or inferred) and the permutation
        from the canonical order; a view that is no known one of the geometry
        keeps its own order, a geometry of sizes < 1 is a ValueError."""
        return {name: RowFormat.of(parts, self.kv.get(name), where=f"layer {name!r}")
                for name, parts in self.row_parts().items()}

    def row_parts(self) -> dict[str, list[list[int]]]:
        """Layer -> the logical element dims of each of its tensors, in row
        order: sizes of the dims other than block and slot, in the tensor's
        logical dim order, not merged by strides - the same for every
        physical order of one logical view, different for another view."""
        out: dict[str, list[list[int]]] = {}
        for t in self.tensors:  # registration order: a layer's tensors in row order
            out.setdefault(t.layer, []).append(list(t.elem_dims))
        return out

    @staticmethod
    def _group_info(gname, g: CacheGroup, tensors: list[LayerTensor]) -> RegisteredGroup:
        sizes = {t.layout.slots_per_block for t in tensors}
        if len(sizes) > 1:
            raise ValueError(
                f"group {gname!r}: layers disagree on the block size (slots per block): "
                f"{sorted(sizes)}; a group shares one block table"
            )
        slots = sizes.pop() if sizes else 1
        if g.dcp.sharded and slots % g.dcp.interleave:
            raise ValueError(
                f"group {gname!r}: interleave {g.dcp.interleave} does not divide the block size {slots}"
            )
        nb = g.num_blocks if g.num_blocks is not None else min((t.layout.num_blocks for t in tensors), default=0)
        return RegisteredGroup(gname, slots, nb, g.dcp)

    def _launch_classes(self) -> tuple[LaunchClass, ...]:
        classes: dict[tuple, LaunchClass] = {}
        for t in self.tensors:
            bank_row = t.bank.shape[1] if t.bank is not None else 0
            part = t.part if t.mode in (V.CONSTANT, V.NORMAL) else None  # its own value table
            k = (t.group, t.layout, t.vdtype, t.mode, bank_row, part)
            if k not in classes:
                classes[k] = LaunchClass(t.group, t.layout, t.vdtype, t.mode, bank_row,
                                         self.bank_table if t.mode == V.REPLAY else None, part=part)
            classes[k].tensors.append(t)
        # One value table per (mode, dtype, item size), long enough for the
        # widest row that reads it.
        max_row: dict[tuple, int] = {}
        for c in classes.values():
            if c.mode == V.REPLAY:  # rows come from each tensor's bank rows
                continue
            k = (c.mode, c.vdtype, c.layout.itemsize, c.part)
            max_row[k] = max(max_row.get(k, 1), c.layout.row_size)
        v = self.values
        tables = {
            k: value_table(k[0], v.mean, v.std, k[1], k[2], self.device, max_row=row, part=k[3])
            for k, row in max_row.items()
        }
        for c in classes.values():
            c.table = tables.get((c.mode, c.vdtype, c.layout.itemsize, c.part))
        return tuple(classes.values())

    def group(self, name: str) -> RegisteredGroup:
        info = self.groups.get(name)
        if info is None:
            raise ValueError(f"group {name!r} is not registered; registered groups: {sorted(self.groups)}")
        return info

    def describe(self) -> str:
        """One line per launch class: group, geometry, dtype, mode, layers."""
        lines = []
        for c in self.classes:
            lay = c.layout
            lines.append(
                f"{c.group}: {len(c.tensors)} tensor(s) x {lay.num_blocks} blocks x "
                f"{lay.slots_per_block} slots x {lay.row_size} elems of {lay.itemsize} B "
                f"[{c.vdtype or 'packed'}, {c.mode}]"
            )
        return "\n".join(lines)
