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

* **A table other than the recording's** (``Rotary.source``): LongRoPE's
  angles come from short or long factors, chosen by ``max_model_len``; a
  bank recorded with the other choice has every key rotated by the other
  table, so every key is turned, ``M_table(t) M_source(p)^-1``, not only
  those past the end (a position below N is then not left as recorded).
* **fp8 keys** (a ``uint8`` cache of ``float8_e4m3fn`` / ``float8_e5m2``
  values, one scale per tensor): dequantising with the scale, rotating and
  requantising with the same scale is the rotation of the stored values
  (it is linear), so they are turned as floats in float32 and rounded to
  fp8 once, saturating at its largest finite value as vLLM's cache writers
  do.
* **DeepSeek's packed rows** (``Rotary.packing``, ``packed_rows.py``): an
  ``fp8_ds_mla`` row's RoPE part is 64 bfloat16 values at byte 528, turned
  as keys are; an indexer row (``"indexer"``; ``"indexer_mx"`` with its
  scale as four UE8M0 bytes) is 128 fp8 values times one power-of-two
  scale whose first ``rotary_dim`` are rotated: dequantised, turned, and
  requantised with vLLM's writer's rule (a new scale ``2^ceil(log2(max(amax,
  1e-4) / 448))`` from the turned key's largest magnitude).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ROTATED_DTYPES = (torch.float16, torch.bfloat16, torch.float32,  # keys rotated as values of one of these
                  torch.float8_e4m3fn, torch.float8_e5m2)
PACKINGS = (None, "fp8_ds_mla", "indexer", "indexer_mx")
DS_MLA_ROPE_BYTES = (528, 656)  # an fp8_ds_mla row's RoPE part: 64 bfloat16 values after 512 fp8 and 4 scales
INDEXER_SCALE_AT = 128  # an indexer row: 128 fp8 values, then its scale's 4 bytes
# Float32 temporaries live at once, per rotated element: the angles' gathered table rows and products; a
# pair's two halves, their products and sums (and fp8's clamps); an indexer row's dequantised values.
ANGLE_TEMPS, TURN_TEMPS, INDEXER_TEMPS = 12, 10, 4
FP8_MAX = 448.0  # what vLLM's indexer writer scales keys to (float8_e4m3fn's largest finite value)


@dataclass(frozen=True)
class Rotary:
    """One layer's rotary keys (module docstring).  ``table``: ``[positions,
    rotary_dim]``, cos for each frequency then sin, any float dtype (kept as
    float32); ``source``: the table the bank's keys were rotated with where
    it is not ``table`` (every key is then turned); ``packing``: None (keys
    stored as values of the rows' dtype) or one of DeepSeek's packed rows."""

    table: torch.Tensor
    heads: int
    head_stride: int
    rotary_dim: int
    neox: bool
    offset: int = 0
    source: torch.Tensor | None = None
    packing: str | None = None

    def __post_init__(self):
        r, d = self.rotary_dim, self.head_stride
        for what, t in (("table", self.table), ("source", self.source)):
            if what == "source" and t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != r:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"a rotary {what} must be [positions, rotary_dim {r}] (cos then sin), got {got}")
        if self.packing not in PACKINGS:
            raise ValueError(f"packing {self.packing!r} is not one of {list(PACKINGS)}")
        if r < 2 or r % 2 or self.heads < 1 or self.offset < 0 or self.offset + r > d:
            raise ValueError(f"rotary_dim {r} from offset {self.offset} does not fit a head of {d} elements "
                             f"({self.heads} heads); expected an even rotary_dim >= 2 within the head")
        width = {"fp8_ds_mla": 64, "indexer": INDEXER_SCALE_AT, "indexer_mx": INDEXER_SCALE_AT}.get(self.packing)
        if width is not None and (self.heads, d, self.offset) != (1, width, 0):
            raise ValueError(f"{self.packing} rows rotate one head of {width} elements from its start; got "
                             f"{self.heads} heads of {d} from offset {self.offset}")

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


def device_table(table: torch.Tensor, device, made: dict) -> torch.Tensor:
    """``table`` as float32 on ``device``: one copy per distinct table,
    whichever layer asks (``made``: id of a host table -> its copy).  A
    model has one table (and a LongRoPE bank its recording's): every layer
    turned by it reads the same copy, not one of its own."""
    key = (id(table), str(device))
    if key not in made:
        made[key] = (table, table.to(device=device, dtype=torch.float32).contiguous())
    return made[key][1]


def table_nbytes(rotary) -> int:
    """Device bytes of the float32 tables the layers of ``rotary`` (layer ->
    ``Rotary``) share: each distinct table once."""
    distinct = {id(t): t for r in rotary.values() for t in (r.table, r.source) if t is not None}
    return sum(t.shape[0] * t.shape[1] * 4 for t in distinct.values())


class Rerotation:
    """A layer's re-rotation on the caches' device: ``apply(rows, t, p)``
    turns rows recorded at positions p into keys at positions t, in place.
    ``order``: the cache's element order of a canonical row (None: the
    same), so the rows may be in the cache's order; ``vdtype``: what their
    bits encode (a packed row's: bytes); ``tables``: the device copies of
    the tables made so far (``device_table``), shared by every layer."""

    def __init__(self, rotary: Rotary, order: np.ndarray | None, vdtype: torch.dtype, device,
                 tables: dict | None = None):
        if rotary.packing is None and vdtype not in ROTATED_DTYPES:
            raise ValueError(f"keys stored as {vdtype} are not re-rotated; expected one of {list(ROTATED_DTYPES)}")
        if rotary.packing is not None and (order is not None or vdtype.itemsize != 1):
            raise ValueError(f"{rotary.packing} rows are bytes in their cache's own order; got {vdtype} rows"
                             f"{' reordered' if order is not None else ''}")
        a, b, freq = rotary.pairs()
        if order is not None:  # canonical index -> its place in the cache's row
            place = np.empty_like(order)
            place[order] = np.arange(order.size)
            a, b = place[a], place[b]
        self.a, self.b = (torch.from_numpy(np.ascontiguousarray(x)).to(device) for x in (a, b))
        tables = {} if tables is None else tables  # shared by the layers of one engine (device_tables)
        self.table = device_table(rotary.table, device, tables)
        self.source = None if rotary.source is None else device_table(rotary.source, device, tables)
        self.key = (id(rotary.table), id(rotary.source))  # layers of one key share their angles (Staging)
        self.half = rotary.rotary_dim // 2
        self.heads, self.stride, self.offset, self.neox = rotary.heads, rotary.head_stride, rotary.offset, rotary.neox
        self.direct = order is None  # the pairs at strided places of the row: turned through views, no gather
        self.positions = rotary.positions
        self.vdtype, self.packing = vdtype, rotary.packing

    @property
    def turns_all(self) -> bool:
        """Every key is turned (the bank was rotated by another table), not only those past a sequence's end."""
        return self.source is not None

    def transient_bytes(self, n: int) -> tuple[int, int]:
        """Device bytes of the float32 temporaries of turning ``n`` rows, at
        their peak: ``(angles, this layer's turn)`` - the angles of one key
        are shared by its layers, which are turned one after another, so a
        fill's peak is one ``angles`` and the largest turn (bounds the
        stand-in's ledger checks, tests/test_device_ledger.py)."""
        angles = ANGLE_TEMPS * n * self.half * 4
        turn = TURN_TEMPS * n * self.heads * self.half * 4
        if self.packing in ("indexer", "indexer_mx"):  # the row dequantised to float32 and requantised
            turn += INDEXER_TEMPS * n * INDEXER_SCALE_AT * 4
        return angles, turn

    def angles(self, t: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's ``M(t) M(p)^-1`` as (cos, sin) ``[n, rotary_dim / 2]``
        float32; the identity, exactly, where t = p and the table is the recording's."""
        source = self.table if self.source is None else self.source
        ct, st = self.table[t, :self.half], self.table[t, self.half:]
        cp, sp = source[p, :self.half], source[p, self.half:]
        den = cp * cp + sp * sp
        cos = (ct * cp + st * sp) / den
        sin = (st * cp - ct * sp) / den
        if self.source is None:
            same = (t == p)[:, None]
            cos = torch.where(same, torch.ones_like(cos), cos)
            sin = torch.where(same, torch.zeros_like(sin), sin)
        return cos, sin

    def apply(self, rows: torch.Tensor, t: torch.Tensor, p: torch.Tensor,
              angles: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """``rows``: ``[n, row]`` bits of the layer's rows (in place); ``t``,
        ``p``: int64 ``[n]`` true and recorded positions on the device;
        ``angles``: ``self.angles(t, p)`` where already computed."""
        if not rows.numel():
            return
        cos, sin = self.angles(t, p) if angles is None else angles
        if self.packing == "fp8_ds_mla":
            self._turn(rows.view(torch.uint8)[:, DS_MLA_ROPE_BYTES[0]:DS_MLA_ROPE_BYTES[1]].view(torch.bfloat16),
                       cos, sin)
        elif self.packing is not None:
            self._turn_indexer(rows.view(torch.uint8), cos, sin, t != p if self.source is None else None)
        else:
            self._turn(rows.view(self.vdtype), cos, sin)

    def _turn(self, values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Each pair of ``values`` ``[n, row]`` turned by its row's (cos, sin), in place."""
        n, c, s = values.shape[0], cos[:, None, :], sin[:, None, :]  # broadcast over heads
        if self.direct:
            r = values[:, :self.heads * self.stride].unflatten(1, (self.heads, self.stride))
            r = r[..., self.offset:self.offset + 2 * self.half]
            if self.neox:
                v1, v2 = r[..., :self.half], r[..., self.half:]
            else:
                pairs = r.unflatten(-1, (self.half, 2))
                v1, v2 = pairs[..., 0], pairs[..., 1]
            x1, x2 = v1.float(), v2.float()
        else:
            x1, x2 = (values.index_select(1, i).float().view(n, self.heads, self.half) for i in (self.a, self.b))
        y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
        if values.dtype.itemsize == 1:  # fp8: saturate at the largest finite value, as vLLM's writers do
            top = torch.finfo(values.dtype).max
            y1, y2 = y1.clamp(-top, top), y2.clamp(-top, top)
        if self.direct:
            v1.copy_(y1)
            v2.copy_(y2)
        else:
            values.index_copy_(1, self.a, y1.reshape(n, -1).to(values.dtype))
            values.index_copy_(1, self.b, y2.reshape(n, -1).to(values.dtype))

    def _turn_indexer(self, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      moved: torch.Tensor | None) -> None:
        """Dequantise, turn, requantise with vLLM's writer's rule (module
        docstring); rows not ``moved`` keep their bytes."""
        keys, scale = rows[:, :INDEXER_SCALE_AT], rows[:, INDEXER_SCALE_AT:INDEXER_SCALE_AT + 4]
        mx = self.packing == "indexer_mx"
        s = torch.exp2(scale[:, 0].float() - 127) if mx else scale.contiguous().view(torch.float32)[:, 0]
        x = keys.view(torch.float8_e4m3fn).float() * s[:, None]
        self._turn(x, cos, sin)
        new = torch.exp2(torch.ceil(torch.log2(x.abs().amax(dim=1).clamp_min(1e-4) / FP8_MAX)))
        q = (x / new[:, None]).to(torch.float8_e4m3fn).view(torch.uint8)
        if mx:
            code = (torch.log2(new) + 127).to(torch.uint8)[:, None].expand(-1, 4)
        else:
            code = new[:, None].contiguous().view(torch.uint8)
        if moved is not None:
            q = torch.where(moved[:, None], q, keys)
            code = torch.where(moved[:, None], code, scale)
        keys.copy_(q)
        scale.copy_(code)
