"""Keys re-rotated to their true positions past a recorded sequence's end
(``past_bank="rotate"``, kernels/rotary.py, kernels/staging.py).

A bank of keys recorded at positions [0, N) with a rotary table; a plan
reaching past N.  The oracle is independent of the engine's code: each
planned slot's true position t and recorded position p from the replay rule
alone, the recorded pair turned by the table's rows t and p in float64, then
rounded once.  Every byte not of a rotated pair - values, a head's
unrotated dims, slots below N, memory around - must equal plain replay's
bytes exactly; rotated elements within one rounding of the oracle (the
float32 arithmetic); both backends and both placements byte-equal to each
other; DCP ranks; an MLA row's RoPE part.  Against vLLM's own rotary
embeddings: ``test_rotary_vllm.py``.
"""
import numpy as np
import pytest
import torch
from oracle import dcp_position, poisoned_buffer
from test_fill_layouts import assert_same_bytes

from kvfill.kernels import Bank, CacheGroup, DcpGeometry, FillEngine, GroupFill
from kvfill.kernels.rotary import Rerotation, Rotary

NB, SLOTS = 8, 8
LENGTHS = [11, 6]  # recorded positions per sequence; entries reach 40
# (block, slot_start, slot_end, local_base, sequence): below and past each sequence's end
ENTRIES = [(1, 0, 8, 0, 0), (2, 0, 8, 8, 0), (5, 2, 8, 32, 0), (3, 0, 8, 0, 1), (6, 0, 5, 16, 1)]


def rope_table(positions: int, rotary_dim: int, base: float = 10000.0, mscale: float = 1.0) -> torch.Tensor:
    """A default RoPE table (cos then sin per frequency), optionally scaled as YaRN's is."""
    inv = 1.0 / base ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    ang = np.arange(positions)[:, None] * inv[None, :]
    return torch.from_numpy(np.concatenate([np.cos(ang), np.sin(ang)], axis=1) * mscale).to(torch.float32)


class Layer:
    """A layer geometry: its caches over a buffer, its canonical K part and its rotary."""

    def __init__(self, name, heads, head, value, rotary_dim, neox, offset=0, permuted=False):
        self.name, self.heads, self.head, self.value = name, heads, head, value
        self.rotary_dim, self.neox, self.offset, self.permuted = rotary_dim, neox, offset, permuted

    @property
    def row(self):
        return self.heads * (self.head + self.value)

    def caches(self, buf, dtype, layers):
        """Per layer, contiguous in ``buf``: ``[B, 2, H, N, D]`` (K heads then
        V heads: the canonical order), ``[B, N, D]`` (MLA's one row), or
        ``[B, H, N, D + Dv]`` (each head's K then V: permuted)."""
        t = buf.view(dtype)[: layers * NB * SLOTS * self.row].view(layers, NB, -1)
        if self.permuted:
            return [t[i].view(NB, self.heads, SLOTS, self.head + self.value) for i in range(layers)]
        if not self.value:
            return [t[i].view(NB, SLOTS, self.head) for i in range(layers)]
        return [t[i].view(NB, 2, self.heads, SLOTS, self.head) for i in range(layers)]

    @property
    def slot_dim(self):
        return 2 if self.permuted else 1 if not self.value else 3

    def kv(self):
        return (self.heads, self.head, self.value)

    def rotary(self, table, source=None):
        return Rotary(table, self.heads, self.head, self.rotary_dim, self.neox, self.offset, source=source)


LAYERS = {
    "neox": Layer("neox", 2, 16, 16, 16, True),
    "gptj-partial": Layer("gptj-partial", 2, 16, 16, 8, False),
    "permuted": Layer("permuted", 2, 16, 16, 16, True, permuted=True),
    "mla": Layer("mla", 1, 24, 0, 8, False, offset=16),  # latent 16 + RoPE part 8, one head, no V
}


FP8 = torch.float8_e4m3fn  # keys of a uint8 cache of kv_cache_dtype fp8_e4m3


def bank_of(geo: Layer, dtype, layers=2, seed=0) -> Bank:
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = {f"l{i}": (torch.randn(sum(LENGTHS), geo.row, generator=g, device="cpu") * 2) for i in range(layers)}
    if dtype != FP8:
        return Bank({n: r.to(dtype) for n, r in rows.items()}, sequence_lengths=LENGTHS, kv={n: geo.kv() for n in rows})
    rows["l0"][:3] = (rows["l0"][:3] * 200).clamp(-440, 440)  # near fp8's largest value: turned past it, saturated
    return Bank({n: r.to(FP8).view(torch.uint8) for n, r in rows.items()}, sequence_lengths=LENGTHS,
                kv={n: geo.kv() for n in rows}, value_dtypes={n: "float8_e4m3fn" for n in rows})


def run(geo, dtype, backend, past_bank, table=None, placement="device", staging_bytes=None, dcp=(1, 0, 1),
        entries=ENTRIES, seed=11, source=None):
    """``dtype`` FP8: a uint8 cache of fp8 keys.  ``source``: the table the bank was recorded with."""
    store = torch.uint8 if dtype == FP8 else dtype
    itemsize = torch.empty((), dtype=store).element_size()
    buf = poisoned_buffer(2 * NB * SLOTS * geo.row * itemsize + 64, seed=seed)
    caches = geo.caches(buf, store, 2)
    bank = bank_of(geo, dtype)
    rotary = {n: geo.rotary(table, source) for n in ("l0", "l1")} if past_bank == "rotate" else None
    eng = FillEngine({"g": CacheGroup({f"l{i}": c for i, c in enumerate(caches)}, kv=geo.kv(), slot_dim=geo.slot_dim,
                                      dcp=DcpGeometry(*dcp), encoding="fp8_e4m3" if dtype == FP8 else "auto")},
                     bank=bank, backend=backend, past_bank=past_bank, rotary=rotary, bank_placement=placement,
                     staging_bytes=staging_bytes)
    plan = {"g": GroupFill(*zip(*entries))} if entries else None
    if plan:
        eng.fill(plan)
    return buf, bank, eng, plan


def rotated_elements(geo: Layer) -> np.ndarray:
    """Canonical indices of a row's rotated elements."""
    out = []
    for h in range(geo.heads):
        out += list(range(h * geo.head + geo.offset, h * geo.head + geo.offset + geo.rotary_dim))
    return np.array(out)


def oracle_row(row64: np.ndarray, geo: Layer, table: np.ndarray, t: int, p: int, source=None) -> np.ndarray:
    """A recorded canonical row (float64) turned from p (by ``source``, else
    the table) to t by the table, per head and pair."""
    out = row64.copy()
    half = geo.rotary_dim // 2
    source = table if source is None else source
    ct, st, cp, sp = table[t, :half], table[t, half:], source[p, :half], source[p, half:]
    den = cp * cp + sp * sp
    c, s = (ct * cp + st * sp) / den, (st * cp - ct * sp) / den
    for h in range(geo.heads):
        k0 = h * geo.head + geo.offset
        i = np.arange(half)
        a, b = (k0 + i, k0 + i + half) if geo.neox else (k0 + 2 * i, k0 + 2 * i + 1)
        out[a] = row64[a] * c - row64[b] * s
        out[b] = row64[b] * c + row64[a] * s
    return out


def slot_row(cache, geo, block, slot):
    """A slot's canonical row read from a layer's cache by its own indexing."""
    if geo.permuted:
        kv = cache[block, :, slot]  # [H, D + Dv]
        return torch.cat([kv[:, :geo.head].reshape(-1), kv[:, geo.head:].reshape(-1)])
    if not geo.value:
        return cache[block, slot]
    return cache[block, :, :, slot].reshape(-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_keys_past_the_end_are_turned_to_their_true_positions_and_nothing_else_changes(name, dtype, backend):
    geo = LAYERS[name]
    table = rope_table(64, geo.rotary_dim, mscale=1.13)
    got, bank, eng, plan = run(geo, dtype, backend, "rotate", table)
    assert eng.verify(plan).ok  # verify reads the bank's rows and turns them as the fill did
    plain, _, _, _ = run(geo, dtype, backend, "wrap")
    rot = rotated_elements(geo)
    eps = torch.finfo(dtype).eps
    changed = 0
    for i, (g_caches, p_caches) in enumerate(zip(geo.caches(got, dtype, 2), geo.caches(plain, dtype, 2))):
        for block, lo, hi, base, seq in ENTRIES:
            for slot in range(lo, hi):
                t = base + slot
                p = t % LENGTHS[seq]
                g_row, p_row = slot_row(g_caches, geo, block, slot), slot_row(p_caches, geo, block, slot)
                if t == p:  # below the end: as recorded, bit for bit
                    assert torch.equal(g_row.contiguous().view(torch.uint8), p_row.contiguous().view(torch.uint8)), \
                        (i, t)
                    continue
                keep = torch.from_numpy(np.setdiff1d(np.arange(geo.row), rot))
                assert torch.equal(g_row[keep].contiguous().view(torch.uint8),
                                   p_row[keep].contiguous().view(torch.uint8)), (i, t)
                want = oracle_row(p_row.double().cpu().numpy(), geo, table.double().numpy(), t, p)[rot]
                err = np.abs(g_row[torch.from_numpy(rot)].double().cpu().numpy() - want)
                assert (err <= 2 * eps * np.abs(want).max() + 1e-30).all(), (i, t, err.max())
                changed += 1
    assert changed > 20
    # nothing else changed: the bytes that differ from plain replay's are at most the rotated elements' bytes
    assert 0 < int((got != plain).sum()) <= changed * rot.size * torch.empty((), dtype=dtype).element_size()


@pytest.mark.parametrize("name", ["neox", "permuted", "mla"])
def test_both_backends_and_both_placements_write_the_same_bytes(name):
    geo = LAYERS[name]
    table = rope_table(64, geo.rotary_dim)
    runs = [run(geo, torch.bfloat16, backend, "rotate", table, placement, staging)
            for backend in ("torch", "triton") for placement, staging in (("device", None), ("device", 1),
                                                                          ("host", 1))]
    for other in runs[1:]:
        assert_same_bytes(other[0], runs[0][0])
    buf, _, eng, plan = runs[-1]  # a host-kept bank, turned: verify agrees, and catches one changed byte
    assert eng.verify(plan).ok
    poison = poisoned_buffer(buf.numel(), seed=11)
    written = (buf != poison).nonzero().flatten()
    buf[int(written[-1])] ^= 0xFF
    assert eng.verify(plan).num_mismatched == 1


@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 4)])
def test_each_dcp_rank_turns_its_slots_from_the_position_its_row_was_recorded_at(world, interleave, backend):
    """Under DCP a rank replays local row l mod L_r of its own positions: the
    recorded position is that row's global position, the true one the
    slot's."""
    geo = LAYERS["neox"]
    table = rope_table(200, geo.rotary_dim)
    entries = [(1, 0, 8, 0, 0), (2, 0, 8, 8, 0), (3, 0, 8, 16, 1)]
    for rank in range(world):
        got, bank, _, _ = run(geo, torch.float32, backend, "rotate", table, dcp=(world, rank, interleave),
                              entries=entries)
        plain, _, _, _ = run(geo, torch.float32, backend, "wrap", dcp=(world, rank, interleave), entries=entries)
        dcp = DcpGeometry(world, rank, interleave)
        for i, (g_caches, p_caches) in enumerate(zip(geo.caches(got, torch.float32, 2),
                                                     geo.caches(plain, torch.float32, 2))):
            for block, lo, hi, base, seq in entries:
                local_len = int(dcp.local_count(LENGTHS[seq])) or interleave
                for slot in range(lo, hi):
                    local = base + slot
                    t = dcp_position(local, world, rank, interleave)
                    p = dcp_position(local % local_len, world, rank, interleave)
                    p_row = slot_row(p_caches, geo, block, slot).double().cpu().numpy()
                    want = oracle_row(p_row, geo, table.double().numpy(), t, p)
                    got_row = slot_row(g_caches, geo, block, slot).double().cpu().numpy()
                    assert np.abs(got_row - want).max() <= 4e-6 * np.abs(want).max(), (rank, i, t, p)


def _slots(geo, got, plain, store, entries=ENTRIES):
    """Each planned slot of each layer: (t, p, its row in ``got``, in ``plain``)."""
    for g_caches, p_caches in zip(geo.caches(got, store, 2), geo.caches(plain, store, 2)):
        for block, lo, hi, base, seq in entries:
            for slot in range(lo, hi):
                t = base + slot
                yield t, t % LENGTHS[seq], slot_row(g_caches, geo, block, slot), slot_row(p_caches, geo, block, slot)


def test_fp8_keys_are_turned_as_floats_and_rounded_to_fp8_once_saturating(backend):
    """A uint8 cache of fp8 keys (one scale per tensor, which the turn's
    linearity cancels): past the end each rotated element is the float64
    oracle rounded to fp8 (within half a unit in the last place), clamped
    to fp8's largest value as vLLM's writers saturate - never NaN; every
    other byte as plain replay wrote it."""
    geo = LAYERS["neox"]
    table = rope_table(64, geo.rotary_dim)
    got, _, eng, plan = run(geo, FP8, backend, "rotate", table)
    assert eng.verify(plan).ok
    plain = run(geo, FP8, backend, "wrap")[0]
    rot = torch.from_numpy(rotated_elements(geo))
    keep = torch.from_numpy(np.setdiff1d(np.arange(geo.row), rot.numpy()))
    turned = saturated = 0
    for t, p, g_row, p_row in _slots(geo, got, plain, torch.uint8):
        g_row, p_row = g_row.cpu(), p_row.cpu()  # the oracle is numpy: host copies of the device's rows
        if t == p:
            assert torch.equal(g_row, p_row), t
            continue
        assert torch.equal(g_row[keep], p_row[keep]), t
        got8 = g_row.contiguous().view(FP8).double()[rot]
        want = torch.from_numpy(oracle_row(p_row.contiguous().view(FP8).double().numpy(), geo,
                                           table.double().numpy(), t, p))[rot]
        assert torch.isfinite(got8).all() and (got8.abs() <= 448).all(), t
        assert ((got8 - want.clamp(-448, 448)).abs() <= want.abs().clamp(max=448) / 16 * 1.01 + 2.0 ** -10).all(), t
        saturated += int((want.abs() > 448).sum())
        turned += 1
    assert turned > 20 and saturated > 0


@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_bank_recorded_with_another_table_has_every_key_turned_from_it(placement, backend):
    """LongRoPE's factor switch: the bank's keys were rotated by another
    table (``Rotary.source``), so every key - below the end too - is turned
    from the recording's angle at p to the engine's at t."""
    geo = LAYERS["gptj-partial"]
    table, source = rope_table(64, geo.rotary_dim, mscale=1.1), rope_table(64, geo.rotary_dim, base=500.0)
    got, _, eng, plan = run(geo, torch.float32, backend, "rotate", table, placement=placement, staging_bytes=1,
                            source=source)
    assert eng.verify(plan).ok
    plain = run(geo, torch.float32, backend, "wrap")[0]
    rot = rotated_elements(geo)
    n = 0
    for t, p, g_row, p_row in _slots(geo, got, plain, torch.float32):
        want = oracle_row(p_row.double().cpu().numpy(), geo, table.double().numpy(), t, p, source.double().numpy())
        assert np.abs(g_row.double().cpu().numpy() - want).max() <= 4e-7 * np.abs(want).max(), (t, p)
        assert not torch.equal(g_row[torch.from_numpy(rot)], p_row[torch.from_numpy(rot)]), (t, p)
        n += 1
    assert n == 2 * sum(hi - lo for _, lo, hi, _, _ in ENTRIES)


def test_a_position_past_the_rotary_table_is_refused_before_any_write():
    geo = LAYERS["neox"]
    buf, _, eng, _ = run(geo, torch.bfloat16, "torch", "rotate", rope_table(30, geo.rotary_dim), entries=None)
    before = buf.clone()
    with pytest.raises(ValueError, match=r"position 39 is past the rotary table's 30 positions"):
        eng.fill({"g": GroupFill(*zip(*ENTRIES))})
    assert torch.equal(buf, before)


def test_integer_keys_and_a_rotary_for_no_replayed_layer_are_refused_naming_why():
    geo = LAYERS["neox"]
    with pytest.raises(ValueError, match=r"keys stored as torch.int8 are not re-rotated"):
        Rerotation(geo.rotary(rope_table(8, 16)), None, torch.int8, "cpu")
    with pytest.raises(ValueError, match=r"indexer rows rotate one head of 128 elements from its start"):
        Rotary(rope_table(8, 16), 2, 64, 16, True, packing="indexer")
    with pytest.raises(ValueError, match=r"a rotary source must be \[positions, rotary_dim 16\]"):
        Rotary(rope_table(8, 16), 2, 64, 16, True, source=rope_table(8, 8))
    with pytest.raises(ValueError, match=r"rotary names layers no replayed group holds: \['l9'\]"):
        buf = poisoned_buffer(2 * NB * SLOTS * geo.row * 2 + 64)
        caches = geo.caches(buf, torch.bfloat16, 2)
        FillEngine({"g": CacheGroup({"l0": caches[0], "l1": caches[1]}, kv=geo.kv(), slot_dim=geo.slot_dim)},
                   bank=bank_of(geo, torch.bfloat16), past_bank="rotate", rotary={"l9": geo.rotary(rope_table(8, 16))})
    with pytest.raises(ValueError, match=r"with past_bank 'wrap'; they are read with past_bank 'rotate' only"):
        FillEngine({"g": CacheGroup({"l0": torch.zeros(2, 2, 4, 16)})}, rotary={"l0": geo.rotary(rope_table(8, 16))})


@pytest.mark.parametrize("placement,way_out", [("device", "past_bank 'wrap'"), ("host", "bank_placement 'device'")])
def test_device_built_entries_are_refused_naming_what_stages_the_group(placement, way_out):
    """A group whose fills stage rows cannot take a plan built on the device
    (CUDA graphs): a re-rotating device-resident bank names past_bank, a
    host-kept bank names its placement (issue 59's G7 named the host for both)."""
    _, _, eng, _ = run(LAYERS["neox"], torch.bfloat16, "triton", "rotate", rope_table(64, 16), placement=placement,
                       entries=None)
    with pytest.raises(ValueError, match=way_out):
        eng.fill_device_entries("g", torch.zeros(1, 5, dtype=torch.int32))
