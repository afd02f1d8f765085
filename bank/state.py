"""The bank's state section: the recurrent state of a hybrid model's linear
layers (gated delta-net, Mamba-1/2, short conv, ...), one per recorded sequence.

What a replay needs of such a layer is not a row per position but the state
the layer carries after the positions the fill wrote: vLLM then computes the
prompt's last token(s) from it, as after real prefill.  A recording of a model
with state layers records each prompt without its last ``t`` tokens (``t``:
the tokens vLLM computes itself, 1, or 2 under speculative decoding), so a
sequence's state is the one after all its recorded positions
(``kvfill.record``), read from the request's own state block.

Layout (TP-independent, canonical)
----------------------------------
A state layer holds the tensors vLLM's ``MambaSpec`` names (``shapes``,
``dtypes``: e.g. gated delta-net's conv state ``[3, conv_dim]`` and its
recurrent state ``[v_heads, k_dim, v_dim]``), each stored as
``[S, *full_shape]`` in its own dtype under the name ``<layer>/state<i>``:
``full_shape`` is the state of all heads / channels, what a TP 1 engine
holds.  Each tensor's ``StateTensor`` says how tensor parallelism cuts it:
along ``dim``, in ``segments`` (sizes summing to ``full_shape[dim]``), each
segment split evenly over the ranks and a rank's pieces concatenated in
segment order - gated delta-net's conv channels pack q, k and v, each
sharded on its own (``segments = [q, k, v]``); a recurrent state is one
segment of heads.  ``dim`` None: the tensor is the same on every rank
(vLLM's ``tp_replicated``).  A rank's page of a state block is its tensors'
bytes one after another in spec order (vLLM's ``MambaBase.bind_kv_cache``):
``pack``.  From vLLM 0.34 a spec may name a ``state_alignment`` of ``a``
bytes: each tensor then starts at a multiple of ``a`` and takes its size
rounded up to ``a`` (the last one too: vLLM's page content is the sum of the
rounded sizes); ``state_offsets`` gives those offsets, ``pack`` and
``unpack`` honour them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from .format import BankError, dtype_name

STATE_SEP = "/state"  # a state tensor's name: <layer>/state<i>


def state_tensor_name(layer: str, i: int) -> str:
    return f"{layer}{STATE_SEP}{i}"


def _dtype(name: str, where: str) -> torch.dtype:
    d = getattr(torch, str(name), None)
    if not isinstance(d, torch.dtype):
        raise BankError(f"{where}: dtype {name!r} is not a torch dtype")
    return d


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of a layer: its full (TP 1) shape, dtype, and how
    tensor parallelism cuts it (module docstring)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    dim: int | None = None
    segments: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(x) for x in self.shape))
        object.__setattr__(self, "segments", tuple(int(x) for x in self.segments))
        if not self.shape or min(self.shape) < 1:
            raise BankError(f"state shape {list(self.shape)}: expected dims >= 1")
        if self.dim is not None:
            if not 0 <= self.dim < len(self.shape):
                raise BankError(f"state of shape {list(self.shape)}: sharded dim {self.dim} is not one of its dims")
            segs = self.segments or (self.shape[self.dim],)
            if min(segs) < 1 or sum(segs) != self.shape[self.dim]:
                raise BankError(f"state of shape {list(self.shape)}: segments {list(segs)} must be sizes >= 1 "
                                f"summing to dim {self.dim}'s {self.shape[self.dim]}")
            object.__setattr__(self, "segments", tuple(segs))

    @property
    def nbytes(self) -> int:
        return self.local_nbytes(0, 1)

    def ranges(self, tp_rank: int, tp_size: int, where: str = "state") -> list[tuple[int, int]]:
        """The index ranges along ``dim`` of the full tensor that TP rank
        ``tp_rank`` of ``tp_size`` holds, in its local order."""
        if self.dim is None or tp_size == 1:
            return [(0, self.shape[self.dim or 0])]
        out, first = [], 0
        for seg in self.segments:
            if seg % tp_size:
                raise BankError(f"{where}: a segment of {seg} along dim {self.dim} of state {list(self.shape)} cannot "
                                f"be split over tensor parallel size {tp_size}; expected a size dividing {seg}")
            per = seg // tp_size
            out.append((first + tp_rank * per, first + (tp_rank + 1) * per))
            first += seg
        return out

    def local_nbytes(self, tp_rank: int, tp_size: int) -> int:
        """The bytes of TP rank ``tp_rank``'s cut (one sequence's state)."""
        return int(np.prod(self.local_shape(tp_rank, tp_size))) * torch.empty((), dtype=self.dtype).element_size()

    def local_shape(self, tp_rank: int, tp_size: int) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        n = sum(b - a for a, b in self.ranges(tp_rank, tp_size))
        return self.shape[:self.dim] + (n,) + self.shape[self.dim + 1:]

    def take(self, full: torch.Tensor, tp_rank: int, tp_size: int, where: str = "state") -> torch.Tensor:
        """A rank's part of ``full`` (``[S, *shape]``)."""
        if self.dim is None or tp_size == 1:
            return full
        d = self.dim + 1
        pieces = [full.narrow(d, a, b - a) for a, b in self.ranges(tp_rank, tp_size, where)]
        return torch.cat(pieces, dim=d) if len(pieces) > 1 else pieces[0].contiguous()

    def merge(self, parts: Sequence[torch.Tensor], where: str = "state") -> torch.Tensor:
        """The full ``[S, *shape]`` from every rank's part, in rank order
        (a replicated tensor: the first, after checking the others equal it)."""
        t = len(parts)
        if self.dim is None or t == 1:
            if any(not torch.equal(p, parts[0]) for p in parts[1:]):
                raise BankError(f"{where}: a state replicated over tensor parallelism differs between ranks")
            return parts[0]
        d = self.dim + 1
        out = []
        for k in range(len(self.segments)):
            for r, p in enumerate(parts):
                (a, b) = self.ranges(r, t, where)[k]
                offset = sum(b2 - a2 for a2, b2 in self.ranges(r, t, where)[:k])
                out.append(p.narrow(d, offset, b - a))
        return torch.cat(out, dim=d).contiguous()

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": dtype_name(self.dtype), "dim": self.dim,
                "segments": list(self.segments)}

    @classmethod
    def from_json(cls, v, where: str) -> "StateTensor":
        if not isinstance(v, dict) or not isinstance(v.get("shape"), list) or not isinstance(v.get("segments"), list) \
                or not all(_is_int(x) for x in v["shape"] + v["segments"]) \
                or not (v.get("dim") is None or _is_int(v.get("dim"))):
            raise BankError(f"{where} is {str(v)[:120]}; expected an object with 'shape' (list of ints), 'dtype', "
                            f"'dim' (null or an int) and 'segments' (list of ints)")
        return cls(tuple(v["shape"]), _dtype(v.get("dtype"), where), v["dim"], tuple(v["segments"]))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


StateLayout = tuple  # tuple[StateTensor, ...]: a layer's state tensors in vLLM's spec order


def layouts_to_json(layouts: Mapping[str, Sequence[StateTensor]]) -> str:
    return json.dumps({n: [s.to_json() for s in st] for n, st in layouts.items()})


def layouts_from_json(raw: str | None, where: str) -> dict[str, StateLayout]:
    """The ``states`` metadata of a bank file or a recorder's part ({} when absent)."""
    if raw is None or raw == "":
        return {}
    try:
        v = json.loads(raw)
    except ValueError as exc:
        raise BankError(f"{where}: metadata 'states' is not JSON ({exc})") from None
    if not isinstance(v, dict) or not all(isinstance(x, list) and x for x in v.values()):
        raise BankError(f"{where}: metadata 'states' is {str(v)[:120]}; expected an object: layer -> a list of "
                        f"state tensors")
    return {n: tuple(StateTensor.from_json(x, f"{where}: metadata 'states'[{n!r}][{i}]") for i, x in enumerate(st))
            for n, st in v.items()}


def _nbytes(shape, dtype: torch.dtype) -> int:
    return int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()


def state_offsets(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype],
                  alignment: int = 1) -> tuple[list[int], int]:
    """(byte offset of each state tensor in a page, the page's content bytes)
    for states ``shapes``/``dtypes`` each rounded up to ``alignment`` bytes
    (vLLM's ``MambaSpec.state_alignment``; 1: one after another)."""
    a = int(alignment)
    if a < 1:
        raise BankError(f"state alignment {alignment!r}: expected an int >= 1")
    offsets, at = [], 0
    for shape, dtype in zip(shapes, dtypes):
        offsets.append(at)
        at += -(-_nbytes(shape, dtype) // a) * a
    return offsets, at


def pack(tensors: Sequence[torch.Tensor], alignment: int = 1) -> torch.Tensor:
    """``[S, bytes]`` uint8: each sequence's state tensors' bytes at the
    offsets of ``state_offsets`` (a state block's page as vLLM lays it out),
    the alignment gaps zero."""
    s = tensors[0].shape[0]
    rows = [t.contiguous().view(torch.uint8).reshape(s, -1) for t in tensors]
    if int(alignment) == 1:
        return torch.cat(rows, dim=1)
    offsets, total = state_offsets([r.shape[1:] for r in rows], [torch.uint8] * len(rows), alignment)
    page = torch.zeros((s, total), dtype=torch.uint8, device=rows[0].device)
    for at, r in zip(offsets, rows):
        page[:, at:at + r.shape[1]] = r
    return page


def unpack(page: torch.Tensor, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype],
           alignment: int = 1) -> list[torch.Tensor]:
    """The state tensors ``[n, *shape]`` of ``n`` pages (``[n, >= bytes]``
    uint8/int8, each tensor at its ``state_offsets`` offset; bytes past the
    states - vLLM's padding - are left), copied."""
    out = []
    rows = page.reshape(page.shape[0], -1).view(torch.uint8)
    offsets, _ = state_offsets(shapes, dtypes, alignment)
    for shape, dtype, offset in zip(shapes, dtypes, offsets):
        nbytes = _nbytes(shape, dtype)
        if offset + nbytes > rows.shape[1]:
            raise BankError(f"a state page of {rows.shape[1]} bytes cannot hold states {[list(s) for s in shapes]} "
                            f"of {[dtype_name(d) for d in dtypes]} (state alignment {alignment})")
        out.append(rows[:, offset:offset + nbytes].contiguous().view(dtype).reshape(-1, *shape))
    return out
