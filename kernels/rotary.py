"""Keys re-rotated to their true positions past a recorded sequence's end
(``FillEngine(past_bank="rotate")``).

Replay writes position t of a request from row ``t mod N`` of a recorded
sequence of N positions: past N the keys are rotated (RoPE) for the position
they were recorded at, p, not for t.  A rotary key is ``M(p) x``: each pair of
elements (x1, x2) of a head's rotary part turned by the model's angle at p,
``M(c, s) = [[c, -s], [s, c]]`` with ``(c, s)`` row p of the model's own
cos/sin table (vLLM's ``cos_sin_cache``: every variant's frequencies and
scaling - default, linear, Llama-3, YaRN with its mscale - are in it).  So
``M(t) M(p)^-1`` turns a recorded key into the key at t,

    M(t) M(p)^-1 = M(ct cp + st sp, st cp - ct sp) / (cp^2 + sp^2)

computed in float32 from the table's rows t and p, applied to the pair and
rounded to the cache's dtype once: the key real prefill would have written
at t, up to the rounding of the recorded key.  Values are not rotated; a
position below N (t = p) is left as recorded, bit for bit.

A layer's rotary part is named in its canonical bank row (``bank/rows.py``):
``heads`` heads of ``head_stride`` elements, each rotating ``rotary_dim``
elements from ``offset`` (0 for attention keys; an MLA row rotates its
RoPE part after the latent), in pairs ``(i, i + rotary_dim/2)`` (NeoX) or
``(2i, 2i + 1)`` (GPT-J), frequency i.  No vLLM import: the connector reads
the table and the style from vLLM's rotary embedding.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ROTATED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # keys rotated as values of one of these


@dataclass(frozen=True)
class Rotary:
    """One layer's rotary keys (module docstring).  ``table``: ``[positions,
    rotary_dim]``, cos for each frequency then sin, any float dtype (kept as
    float32)."""

    table: torch.Tensor
    heads: int
    head_stride: int
    rotary_dim: int
    neox: bool
    offset: int = 0

    def __post_init__(self):
        r, d = self.rotary_dim, self.head_stride
        if not isinstance(self.table, torch.Tensor) or self.table.dim() != 2 or self.table.shape[1] != r:
            got = tuple(self.table.shape) if isinstance(self.table, torch.Tensor) else type(self.table).__name__
            raise ValueError(f"a rotary table must be [positions, rotary_dim {r}] (cos then sin), got {got}")
        if r < 2 or r % 2 or self.heads < 1 or self.offset < 0 or self.offset + r > d:
            raise ValueError(f"rotary_dim {r} from offset {self.offset} does not fit a head of {d} elements "
                             f"({self.heads} heads); expected an even rotary_dim >= 2 within the head")

    @property
    def positions(self) -> int:
        """Positions the table covers: a key can be rotated to ``[0, positions)``."""
        return int(self.table.shape[0])

    def pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Canonical row indices of each rotated pair's two elements and its frequency."""
        half = self.rotary_dim // 2
        i = np.arange(half)
        first, second = (i, i + half) if self.neox else (2 * i, 2 * i + 1)
        heads = np.arange(self.heads)[:, None] * self.head_stride + self.offset
        return ((heads + first).reshape(-1), (heads + second).reshape(-1),
                np.tile(i, self.heads))


class Rerotation:
    """A layer's re-rotation on the caches' device: ``apply(rows, t, p)``
    turns rows recorded at positions p into keys at positions t, in place.
    ``order``: the cache's element order of a canonical row (None: the
    same), so the rows may be in the cache's order; ``vdtype``: what their
    bits encode."""

    def __init__(self, rotary: Rotary, order: np.ndarray | None, vdtype: torch.dtype, device):
        if vdtype not in ROTATED_DTYPES:
            raise ValueError(f"keys stored as {vdtype} are not re-rotated (dequantising and requantising them "
                             f"with their scales is not implemented); expected one of {list(ROTATED_DTYPES)}")
        a, b, freq = rotary.pairs()
        if order is not None:  # canonical index -> its place in the cache's row
            place = np.empty_like(order)
            place[order] = np.arange(order.size)
            a, b = place[a], place[b]
        self.a, self.b = (torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in (a, b))
        self.freq = torch.from_numpy(np.ascontiguousarray(freq)).to(device)
        self.table = rotary.table.to(device=device, dtype=torch.float32)
        self.half = rotary.rotary_dim // 2
        self.positions = rotary.positions
        self.vdtype = vdtype

    def apply(self, rows: torch.Tensor, t: torch.Tensor, p: torch.Tensor) -> None:
        """``rows``: ``[n, row]`` bits of the layer's rows (in place); ``t``,
        ``p``: int64 ``[n]`` true and recorded positions on the device."""
        if not rows.numel():
            return
        values = rows.view(self.vdtype)
        ct, st = self.table[t, :self.half], self.table[t, self.half:]
        cp, sp = self.table[p, :self.half], self.table[p, self.half:]
        den = cp * cp + sp * sp
        cos = (ct * cp + st * sp) / den
        sin = (st * cp - ct * sp) / den
        same = (t == p)[:, None]  # recorded where it is replayed: the identity, exactly
        cos = torch.where(same, torch.ones_like(cos), cos)[:, self.freq]
        sin = torch.where(same, torch.zeros_like(sin), sin)[:, self.freq]
        x1, x2 = values[:, self.a].float(), values[:, self.b].float()
        values[:, self.a] = (x1 * cos - x2 * sin).to(self.vdtype)
        values[:, self.b] = (x2 * cos + x1 * sin).to(self.vdtype)
