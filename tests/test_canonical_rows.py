"""Canonical bank rows (bank/rows.py): a bank recorded from one cache
layout replays into every other layout that holds the same K and V.

A bank is recorded the way the connector's recorder does it (``engine.read``,
then ``RowFormat.to_bank``) from caches whose K and V were written through each
layout's own indexing; it is replayed into another layout, both backends, in
poisoned memory.  The oracle writes each token's K and V for head h through
the destination layout's own indexing (written out below, independent of
bank/rows.py and of the engine's layouts) into a copy of the buffer: every byte
must equal it, so a head or K/V mix-up and a stray write both fail.
"""
import numpy as np
import pytest
import torch
from cases import CASES
from cases import HEAD_DIM as ZOO_HEAD_DIM
from cases import HEADS as ZOO_HEADS
from oracle import poisoned_buffer, write_expected
from test_fill_layouts import assert_same_bytes

from kvfill.bank.rows import RowFormat, infer_geometry
from kvfill.connector.cpu_layout import cpu_kv_parts
from kvfill.kernels import Bank, BankError, CacheGroup, FillEngine, GroupFill
from kvfill.kernels import values as V
from kvfill.kernels.testing import standard_views

NB, N, D = 6, 8, 8        # manager blocks, slots per block, head size (= head_size_v)
LAYERS = ("l0", "l1")
LENGTHS = [5, 11, 8]      # recorded sequences: a ragged bank of 24 rows
STARTS = [0, 5, 16]
# Where the source caches hold each sequence: (block, slot_end, local_base) per block.
RECORD_BLOCKS = [[(0, 5, 0)], [(1, 8, 0), (2, 3, 8)], [(3, 8, 0)]]
# Replay entries (block, slot_start, slot_end, local_base, sequence): positions
# past each sequence's length wrap within it; blocks 2 and 3 stay untouched.
REPLAY_ENTRIES = [(4, 3, 8, 0, 0), (1, 0, 8, 8, 1), (5, 0, 2, 16, 2), (0, 0, 8, 0, 2)]
DTYPES = {"bf16": (torch.bfloat16, "auto"), "fp32": (torch.float32, "auto"), "u8-fp8e4m3": (torch.uint8, "fp8_e4m3")}


# ------------------------------------------------------------------ layouts
class Layout:
    """One cache layout of 2 layers: ``make`` builds the registered tensors
    over a buffer, ``kv(layer tensors, block, slot)`` gives that token's K
    and V ``[H, D]`` as views, by the layout's own indexing."""

    def __init__(self, name, nbytes, make, kv, **group):
        self.name, self.nbytes, self.make, self.kv, self.group = name, nbytes, make, kv, group

    def engine_group(self, layers, h, encoding, **kw):
        group = dict(self.group)
        if group.pop("needs_kv", False):
            group["kv"] = (h, D, D)
        return CacheGroup(layers, num_blocks=NB, encoding=encoding, **{**group, **kw})

    def __repr__(self):
        return self.name


def _dense(buf, dtype, shape):
    n = int(np.prod(shape))
    t = buf.view(dtype)
    return [t[i * n:(i + 1) * n].view(*shape) for i in range(len(LAYERS))]


def _nbytes(h, itemsize, pad=0):
    return len(LAYERS) * (NB * 2 * N * h * D * itemsize + pad)


def _cpu_make(buf, dtype, h):
    # vLLM CPU: [B, H, N, 2D] allocated, used as a (block, head) page of K^T [D, N] then V [N, D].
    return {n: cpu_kv_parts(c, D) for n, c in zip(LAYERS, _dense(buf, dtype, (NB, h, N, 2 * D)))}


def _cpu_kv(t, b, s):
    k, v = t  # cpu_kv_parts' views: their storage is the [B, H, N, 2D] cache; index its pages directly
    h = k.shape[1]
    page = torch.as_strided(k, (h, 2 * N * D), (2 * N * D, 1), k.storage_offset() + b * k.stride(0))
    return page[:, :N * D].view(h, D, N)[:, :, s], page[:, N * D:].view(h, N, D)[:, s, :]


def _hnd_make(buf, dtype, h):
    stored = _dense(buf, dtype, (NB, 2, h, N, D))
    return {n: t.permute(0, 1, 3, 2, 4) for n, t in zip(LAYERS, stored)}  # seen as (B, 2, N, H, D)


def _std_make(order, split=1):
    def make(buf, dtype, h):
        _, views = standard_views(len(LAYERS), NB * split, h, N // split, 2 * D, dtype, order, raw=buf)
        return dict(zip(LAYERS, views))
    return make


def _std_kv(split=1):
    def kv(t, b, s):
        kb, ks = b * split + s // (N // split), s % (N // split)
        return t[kb, :, ks, :D], t[kb, :, ks, D:]
    return kv


def _fa_split_kv(t, b, s):
    return t[0, 2 * b + s // (N // 2), s % (N // 2)], t[1, 2 * b + s // (N // 2), s % (N // 2)]


LAYOUTS = {lay.name: lay for lay in [
    Layout("cpu-kv", _nbytes, _cpu_make, _cpu_kv, slot_dim=2),
    Layout("flash-attn", _nbytes, lambda buf, dt, h: dict(zip(LAYERS, _dense(buf, dt, (2, NB, N, h, D)))),
           lambda t, b, s: (t[0, b, s], t[1, b, s]), block_dim=1, slot_dim=2),
    Layout("flashinfer-nhd", _nbytes, lambda buf, dt, h: dict(zip(LAYERS, _dense(buf, dt, (NB, 2, N, h, D)))),
           lambda t, b, s: (t[b, 0, s], t[b, 1, s]), slot_dim=2),
    Layout("flashinfer-hnd", _nbytes, _hnd_make,
           lambda t, b, s: (t.permute(0, 1, 3, 2, 4)[b, 0, :, s], t.permute(0, 1, 3, 2, 4)[b, 1, :, s]),
           slot_dim=2),
    Layout("std-LBNHC", _nbytes, _std_make("LBNHC"), _std_kv(), slot_dim=2, needs_kv=True),
    Layout("std-BHLNC", _nbytes, _std_make("BHLNC"), _std_kv(), slot_dim=2, needs_kv=True),
    Layout("std-kernel-split2", _nbytes, _std_make("LBNHC", 2), _std_kv(2), slot_dim=2, needs_kv=True),
    Layout("flash-attn-kernel-split2", _nbytes,
           lambda buf, dt, h: dict(zip(LAYERS, _dense(buf, dt, (2, 2 * NB, N // 2, h, D)))), _fa_split_kv,
           block_dim=1, slot_dim=2),
]}


def _hnd_kv_stored(t, b, s):
    """flashinfer-hnd through its stored (B, 2, H, N, D) order (the permuted view undone)."""
    stored = t.permute(0, 1, 3, 2, 4)
    assert stored.is_contiguous()
    return stored[b, 0, :, s], stored[b, 1, :, s]


LAYOUTS["flashinfer-hnd"].kv = _hnd_kv_stored


# ------------------------------------------------------------------ truth
def truth(h, dtype, layer):
    """Known distinct K and V per recorded row, ``[T, H, D]`` each, as bits of
    ``dtype``: element (row t, K/V, head, d) holds 1 + its index among all
    (2- and 4-byte dtypes: every element of a layer distinct; 1-byte: distinct
    within a row)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    bits = V.BITS_DTYPE[itemsize]
    total = sum(LENGTHS)
    idx = torch.arange(total * 2 * h * D, dtype=torch.int64, device="cpu").view(total, 2, h, D)
    idx = idx + 1 + layer * (1 << (8 * itemsize - 2) if itemsize > 1 else 7)
    if itemsize == 1:
        idx = idx % 251
    t = idx.to(bits).view(dtype)
    return t[:, 0], t[:, 1]


def _bits(x):
    return x.contiguous().view(V.BITS_DTYPE[x.element_size()])


def write_sequences(layout, layers, h, dtype):
    """The recorded tokens' K and V, written into the source caches through
    the layout's own indexing (what the model's forward leaves there)."""
    for li, name in enumerate(LAYERS):
        k_true, v_true = truth(h, dtype, li)
        for q, blocks in enumerate(RECORD_BLOCKS):
            for b, end, base in blocks:
                for s in range(end):
                    k, v = layout.kv(layers[name], b, s)
                    k.copy_(k_true[STARTS[q] + base + s])
                    v.copy_(v_true[STARTS[q] + base + s])


def record(layout, h, dtype, encoding):
    """A bank recorded from ``layout``: engine.read of the recorded blocks,
    then RowFormat.to_bank (as connector/recorder.py does)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = poisoned_buffer(layout.nbytes(h, itemsize), seed=31)
    layers = layout.make(buf, dtype, h)
    write_sequences(layout, layers, h, dtype)
    eng = FillEngine({"g": layout.engine_group(layers, h, encoding)})
    formats = eng.row_formats()
    assert {n: f.kv for n, f in formats.items()} == {n: (h, D, D) for n in LAYERS}
    flat = [x for blocks in RECORD_BLOCKS for x in blocks]
    read = eng.read({"g": GroupFill([b for b, _, _ in flat], slot_end=[e for _, e, _ in flat],
                                    local_base=[base for _, _, base in flat])})
    rows = {n: formats[n].to_bank(r).cpu() for n, r in read.items()}
    for li, name in enumerate(LAYERS):  # the canonical row, by its definition: K [H, D] then V [H, D]
        k_true, v_true = truth(h, dtype, li)
        want = torch.cat([k_true.reshape(len(k_true), -1), v_true.reshape(len(v_true), -1)], dim=1)
        assert torch.equal(_bits(rows[name]), _bits(want)), f"{layout.name}: recorded rows of {name} not canonical"
    return Bank(rows, sequence_lengths=LENGTHS, kv={n: formats[n].kv for n in LAYERS},
                value_dtypes={n: "float8_e4m3fn" for n in LAYERS} if encoding == "fp8_e4m3" else None,
                source=f"bank from {layout.name}")


def replay_and_check(bank, layout, h, dtype, encoding, backend):
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = poisoned_buffer(layout.nbytes(h, itemsize), seed=32)
    poison, expected = buf.clone(), buf.clone()
    layers = layout.make(buf, dtype, h)
    eng = FillEngine({"g": layout.engine_group(layers, h, encoding)}, bank=bank, backend=backend)
    plan = {"g": GroupFill(*zip(*REPLAY_ENTRIES))}
    eng.fill(plan)

    want = layout.make(expected, dtype, h)
    for li, name in enumerate(LAYERS):
        k_true, v_true = truth(h, dtype, li)
        for b, lo, hi, base, q in REPLAY_ENTRIES:
            for s in range(lo, hi):
                row = STARTS[q] + (base + s) % LENGTHS[q]
                k, v = layout.kv(want[name], b, s)
                k.copy_(k_true[row])
                v.copy_(v_true[row])
                # and read straight back from the filled caches: head by head
                got_k, got_v = layout.kv(layers[name], b, s)
                for head in range(h):  # the truth is host memory, the caches the device's
                    assert torch.equal(_bits(got_k[head]), _bits(k_true[row, head]).to(got_k.device)), \
                        (name, b, s, "K", head)
                    assert torch.equal(_bits(got_v[head]), _bits(v_true[row, head]).to(got_v.device)), \
                        (name, b, s, "V", head)
    assert_same_bytes(buf, expected)
    assert (buf != poison).any()
    assert eng.verify(plan).ok
    return buf


# ------------------------------------------------------------------ replay
GPU_LAYOUTS = [n for n in LAYOUTS if n != "cpu-kv"]


@pytest.mark.parametrize("dst", GPU_LAYOUTS)
@pytest.mark.parametrize("h", [2, 3, 4])
def test_a_bank_recorded_from_vllm_cpus_k_and_v_views_replays_into_every_gpu_layout(h, dst, backend):
    bank = record(LAYOUTS["cpu-kv"], h, torch.bfloat16, "auto")
    assert bank.kv == {n: (h, D, D) for n in LAYERS} and bank.lengths == tuple(LENGTHS)
    replay_and_check(bank, LAYOUTS[dst], h, torch.bfloat16, "auto", backend)


@pytest.mark.parametrize("dst", ["cpu-kv", "flashinfer-hnd", "std-BHLNC"])
@pytest.mark.parametrize("h", [2, 4])
def test_a_bank_recorded_on_flash_attention_replays_into_cpu_views_and_others(h, dst, backend):
    bank = record(LAYOUTS["flash-attn"], h, torch.bfloat16, "auto")
    replay_and_check(bank, LAYOUTS[dst], h, torch.bfloat16, "auto", backend)


@pytest.mark.parametrize("src, dst", [("std-BHLNC", "cpu-kv"), ("std-kernel-split2", "flash-attn"),
                                      ("flashinfer-hnd", "std-LBNHC")])
def test_banks_recorded_on_other_layouts_replay_alike(src, dst, backend):
    bank = record(LAYOUTS[src], 3, torch.bfloat16, "auto")
    replay_and_check(bank, LAYOUTS[dst], 3, torch.bfloat16, "auto", backend)


@pytest.mark.parametrize("dtype", ["fp32", "u8-fp8e4m3"])
@pytest.mark.parametrize("src, dst", [("cpu-kv", "flash-attn"), ("flash-attn", "cpu-kv"), ("cpu-kv", "std-LBNHC")])
def test_other_storage_dtypes_replay_canonical_rows_alike(src, dst, dtype, backend):
    dt, encoding = DTYPES[dtype]
    bank = record(LAYOUTS[src], 2, dt, encoding)
    replay_and_check(bank, LAYOUTS[dst], 2, dt, encoding, backend)


def test_every_layout_replays_the_same_tokens_the_same_k_and_v():
    """All destinations filled from one bank agree token by token (torch backend)."""
    bank = record(LAYOUTS["cpu-kv"], 3, torch.bfloat16, "auto")
    seen = {}
    for name, layout in LAYOUTS.items():
        buf = replay_and_check(bank, layout, 3, torch.bfloat16, "auto", "torch")
        layers = layout.make(buf, torch.bfloat16, 3)
        seen[name] = torch.stack([torch.stack([_bits(x) for x in layout.kv(layers["l1"], b, s)])
                                  for b, lo, hi, _, _ in REPLAY_ENTRIES for s in range(lo, hi)])
    first = next(iter(seen.values()))
    assert all(torch.equal(v, first) for v in seen.values()), [n for n, v in seen.items() if not torch.equal(v, first)]


def test_a_bank_saved_and_loaded_keeps_its_kv_and_replays_the_same_bytes(tmp_path, backend):
    pytest.importorskip("safetensors")
    bank = record(LAYOUTS["cpu-kv"], 2, torch.bfloat16, "auto")
    bank.save(tmp_path / "b.safetensors")
    back = Bank.load(tmp_path / "b.safetensors")
    assert back.kv == bank.kv == {n: (2, D, D) for n in LAYERS} and back.lengths == tuple(LENGTHS)
    assert all(torch.equal(_bits(back.layers[n]), _bits(bank.layers[n])) for n in LAYERS)
    a = replay_and_check(bank, LAYOUTS["flash-attn"], 2, torch.bfloat16, "auto", backend)
    b = replay_and_check(back, LAYOUTS["flash-attn"], 2, torch.bfloat16, "auto", backend)
    assert torch.equal(a, b)


# ------------------------------------------------------------------ the zoo
ZOO_KV = [c for c in CASES if c.name not in ("mla", "mamba-states")]


def zoo_row(case, k, v):
    """A token's row in a zoo layout's logical element order, from its K and
    V ``[H, D]``: (2, ..., H, D) views hold K of every head, then V; the
    [B, H, N, 2 x head] views hold each head's K then its V."""
    if case.name.startswith(("fa-", "nhd-", "hnd-")):
        return torch.cat([k.reshape(-1), v.reshape(-1)])
    return torch.cat([k, v], dim=1).reshape(-1)


@pytest.mark.parametrize("case", ZOO_KV, ids=lambda c: c.name)
def test_a_canonical_bank_replays_into_every_kv_layout_of_the_zoo(case, backend):
    """The zoo's own layouts (vLLM-built where vLLM exists: six orders, a
    kernel-block split, padded pages; FlashAttention, FlashInfer NHD / HND),
    their geometry given (2 heads x 4) as the connector gives it."""
    h, d = ZOO_HEADS, ZOO_HEAD_DIM
    k_true = torch.arange(sum(LENGTHS) * h * d, dtype=torch.int16, device="cpu").view(-1, h, d) + 1
    v_true = -k_true
    bank = Bank({n: torch.cat([k_true.reshape(len(k_true), -1), v_true.reshape(len(v_true), -1)], dim=1)
                 .view(torch.bfloat16) for n in ("layer.0", "layer.1")},
                sequence_lengths=LENGTHS, kv={n: (h, d, d) for n in ("layer.0", "layer.1")})
    buf = poisoned_buffer(case.nbytes(2), seed=60)
    expected = buf.clone()
    layers = case.make(buf, torch.bfloat16)
    eng = FillEngine({"g": CacheGroup(layers, num_blocks=NB, block_dim=case.block_dim, slot_dim=case.slot_dim,
                                      kv=(h, d, d))}, bank=bank, backend=backend)
    plan = {"g": GroupFill(*zip(*REPLAY_ENTRIES))}
    eng.fill(plan)
    want = case.make(expected, torch.bfloat16)
    for name in want:
        for b, lo, hi, base, q in REPLAY_ENTRIES:
            for s in range(lo, hi):
                row = STARTS[q] + (base + s) % LENGTHS[q]
                write_expected(want[name], block_dim=case.block_dim, slot_dim=case.slot_dim,
                               kernel_split=case.kernel_split, block=b, slot=s,
                               bits=zoo_row(case, k_true[row], v_true[row]))
    assert_same_bytes(buf, expected)
    assert eng.verify(plan).ok


# ------------------------------------------------------------------ MLA
MLA = 36


def _mla_caches(buf, dtype, transposed=False):
    n = NB * N * MLA
    t = buf.view(dtype)[5:]  # views need not start at their buffer
    if transposed:  # stored [N, B, latent]: block dim 0 of the view is not the outer one
        return {name: t[i * n:(i + 1) * n].view(N, NB, MLA).permute(1, 0, 2) for i, name in enumerate(LAYERS)}
    return {name: t[i * n:(i + 1) * n].view(NB, N, MLA) for i, name in enumerate(LAYERS)}


def test_mla_rows_are_the_latent_row_and_replay_into_another_physical_order(backend):
    nbytes = (len(LAYERS) * NB * N * MLA + 5) * 2
    src = poisoned_buffer(nbytes, seed=40)
    caches = _mla_caches(src, torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(41)
    lat = {n: torch.randint(0, 1 << 15, (sum(LENGTHS), MLA), generator=g, device="cpu", dtype=torch.int16)
           for n in LAYERS}
    for q, blocks in enumerate(RECORD_BLOCKS):
        for b, end, base in blocks:
            for s in range(end):
                for n in LAYERS:
                    caches[n][b, s].view(torch.int16).copy_(lat[n][STARTS[q] + base + s])
    eng = FillEngine({"g": CacheGroup(caches, slot_dim=1)})
    fmt = eng.row_formats()
    assert {n: (f.kv, f.order) for n, f in fmt.items()} == {n: ((1, MLA, 0), None) for n in LAYERS}
    flat = [x for blocks in RECORD_BLOCKS for x in blocks]
    read = eng.read({"g": GroupFill([b for b, _, _ in flat], slot_end=[e for _, e, _ in flat],
                                    local_base=[x for _, _, x in flat])})
    bank = Bank({n: fmt[n].to_bank(r) for n, r in read.items()}, sequence_lengths=LENGTHS,
                kv={n: fmt[n].kv for n in LAYERS})
    assert all(torch.equal(bank.layers[n].view(torch.int16).cpu(), lat[n].cpu()) for n in LAYERS)  # on the host

    buf = poisoned_buffer(nbytes, seed=42)
    expected = buf.clone()
    dst = _mla_caches(buf, torch.bfloat16, transposed=True)
    replay = FillEngine({"g": CacheGroup(dst, slot_dim=1)}, bank=bank, backend=backend)
    plan = {"g": GroupFill(*zip(*REPLAY_ENTRIES))}
    replay.fill(plan)
    want = _mla_caches(expected, torch.bfloat16, transposed=True)
    for b, lo, hi, base, q in REPLAY_ENTRIES:
        for s in range(lo, hi):
            for n in LAYERS:
                want[n][b, s].view(torch.int16).copy_(lat[n][STARTS[q] + (base + s) % LENGTHS[q]])
    assert_same_bytes(buf, expected)
    assert replay.verify(plan).ok

    other = {n: torch.zeros(NB, N, 32, dtype=torch.bfloat16) for n in LAYERS}  # another latent size
    with pytest.raises(BankError, match=r"layer 'l0' was recorded with \[1, 36, 0\] \(heads, head_size, "
                                        r"head_size_v\), the cache holds \[1, 32, 0\]"):
        FillEngine({"g": CacheGroup(other, slot_dim=1)}, bank=bank)


# ------------------------------------------------------------------ refusals
def _canonical_bank(h=2, d=D):
    g = torch.Generator(device="cpu").manual_seed(50)
    rows = {n: torch.randn(sum(LENGTHS), 2 * h * d, generator=g, device="cpu").to(torch.bfloat16) for n in LAYERS}
    return Bank(rows, sequence_lengths=LENGTHS, kv={n: (h, d, d) for n in LAYERS}, source="b.safetensors")


@pytest.mark.parametrize("dst, h, d, kv", [
    ("flash-attn", 4, 4, None),            # the view names (4, 4, 4)
    ("cpu-kv", 4, 4, None),                # K/V views [4, 4] + [4, 4]
    ("std-LBNHC", 4, 4, (4, 4, 4)),        # [B, 4, N, 8] with its geometry given
])
def test_a_bank_of_another_kv_geometry_is_refused_naming_both(dst, h, d, kv):
    """Rows of 2 heads x 8 (32 elements) into caches of 4 heads x 4 (also 32):
    the same row size, another model; nothing is written."""
    bank = _canonical_bank(2, 8)
    layout = LAYOUTS[dst]
    buf = poisoned_buffer(len(LAYERS) * NB * 2 * N * h * d * 2, seed=51)
    poison = buf.clone()
    n = NB * 2 * N * h * d
    t = buf.view(torch.bfloat16)
    if dst == "flash-attn":
        layers = {name: t[i * n:(i + 1) * n].view(2, NB, N, h, d) for i, name in enumerate(LAYERS)}
    elif dst == "cpu-kv":
        layers = {name: cpu_kv_parts(t[i * n:(i + 1) * n].view(NB, h, N, 2 * d), d) for i, name in enumerate(LAYERS)}
    else:
        layers = {name: t[i * n:(i + 1) * n].view(NB, h, N, 2 * d) for i, name in enumerate(LAYERS)}
    group = dict(layout.group)
    group.pop("needs_kv", None)
    with pytest.raises(BankError, match=r"b\.safetensors: layer 'l0' was recorded with \[2, 8, 8\] \(heads, "
                                        r"head_size, head_size_v\), the cache holds \[4, 4, 4\]: another model"):
        FillEngine({"g": CacheGroup(layers, kv=kv, **group)}, bank=bank)
    assert torch.equal(buf, poison)


@pytest.mark.parametrize("how", ["std-without-kv", "flat-row", "kv-not-of-the-view"])
def test_a_canonical_bank_into_a_cache_of_no_known_kv_view_is_refused(how):
    bank = _canonical_bank(2, 8)
    buf = poisoned_buffer(len(LAYERS) * NB * N * 32 * 2, seed=52)
    poison = buf.clone()
    t = buf.view(torch.bfloat16).view(len(LAYERS), NB, N * 32)
    if how == "std-without-kv":  # [B, H, N, 2D]: [2, 16] may be one head of 16; its geometry is not given
        layers, kv, dims = {n: t[i].view(NB, 2, N, 16) for i, n in enumerate(LAYERS)}, None, r"\[\[2, 16\]\]"
        hint = r" \(give the engine the layer's geometry: CacheGroup\(kv=\.\.\.\)\)"
    elif how == "flat-row":  # [B, N, 32] with the geometry given: no view of (2, 8, 8) is one flat dim
        layers, kv, dims = {n: t[i].view(NB, N, 32) for i, n in enumerate(LAYERS)}, (2, 8, 8), r"\[\[32\]\]"
        hint = ""
    else:  # [B, N, 4, 8] given (2, 8, 8): 4 x 8 is none of its views
        layers, kv, dims = {n: t[i].view(NB, N, 4, 8) for i, n in enumerate(LAYERS)}, (2, 8, 8), r"\[\[4, 8\]\]"
        hint = ""
    slot_dim = 2 if how == "std-without-kv" else 1
    with pytest.raises(BankError, match=r"layer 'l0' holds K/V rows of \[2, 8, 8\] \(heads, head_size, "
                                        r"head_size_v\); the cache's element dims " + dims + r" are no known K/V "
                                        r"view" + hint):
        FillEngine({"g": CacheGroup(layers, slot_dim=slot_dim, kv=kv)}, bank=bank)
    assert torch.equal(buf, poison)


def test_the_geometry_can_be_given_per_layer():
    """CacheGroup(kv={layer: ...}): a layer given none is inferred (or native)."""
    t = torch.zeros(2, NB, 2, N, 16, dtype=torch.bfloat16)
    eng = FillEngine({"g": CacheGroup({"l0": t[0], "l1": t[1]}, slot_dim=2, kv={"l0": (2, 8, 8)})})
    f = eng.row_formats()
    assert f["l0"].kv == (2, 8, 8) and f["l0"].order is not None and f["l1"].kv is None
    with pytest.raises(BankError, match=r"layer 'l1' holds K/V rows .* are no known K/V view"):
        FillEngine({"g": CacheGroup({"l0": t[0], "l1": t[1]}, slot_dim=2, kv={"l0": (2, 8, 8)})},
                   bank=_canonical_bank(2, 8))


# ------------------------------------------------------------------ RowFormat
GEOMETRIES = [(1, 4, 4), (2, 4, 4), (3, 8, 8), (4, 2, 2), (2, 3, 5), (3, 4, 2), (1, 36, 0), (1, 6, 6)]


def views_of(h, d, dv):
    """Every view of a geometry, with the label (K/V, head, index) of each
    element in row-major order: the cache's element order, by definition."""
    def labels(dims, label):
        return [label(ix) for ix in np.ndindex(*dims)]

    out = {}
    if dv:
        out["k-and-v"] = ([[h, d], [h, dv]], labels((h, d), lambda i: ("K", i[0], i[1]))
                          + labels((h, dv), lambda i: ("V", i[0], i[1])))
        out["per-head-k-then-v"] = ([[h, d + dv]], labels((h, d + dv), lambda i: (
            ("K", i[0], i[1]) if i[1] < d else ("V", i[0], i[1] - d))))
    else:
        out["mla"] = ([[d]], labels((d,), lambda i: ("K", 0, i[0])))
    if dv == d:
        out["kv-outermost"] = ([[2, h, d]], labels((2, h, d), lambda i: ("KV"[i[0]], i[1], i[2])))
    return out


def canonical_labels(h, d, dv):
    return [("K", a, b) for a in range(h) for b in range(d)] + [("V", a, b) for a in range(h) for b in range(dv)]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_row_format_orders_are_the_permutation_each_view_defines(geometry):
    h, d, dv = geometry
    canon = {lab: i for i, lab in enumerate(canonical_labels(h, d, dv))}
    rng = np.random.default_rng(sum(geometry))
    for name, (parts, labels) in views_of(h, d, dv).items():
        fmt = RowFormat.of(parts, geometry)
        assert fmt.kv == geometry and fmt.canonical, name
        want = np.array([canon[lab] for lab in labels])
        order = np.arange(h * (d + dv)) if fmt.order is None else fmt.order
        assert sorted(order.tolist()) == list(range(h * (d + dv))), f"{name}: not a permutation"
        assert np.array_equal(order, want), name
        x = rng.integers(0, 1 << 20, (5, h * (d + dv)))
        assert np.array_equal(fmt.to_bank(fmt.to_cache(x)), x) and np.array_equal(fmt.to_cache(fmt.to_bank(x)), x)
        xt = torch.from_numpy(x)
        assert torch.equal(fmt.to_bank(fmt.to_cache(xt)), xt) and torch.equal(fmt.to_cache(fmt.to_bank(xt)), xt)
        # to_cache puts canonical element order[i] at cache element i
        canon_row = torch.arange(h * (d + dv))
        assert fmt.to_cache(canon_row).tolist() == want.tolist()
        # dims of size 1 (one head) are ignored, as the registry leaves them out
        if h == 1:
            ones = [[1, *p] for p in parts]
            assert RowFormat.of(ones, geometry).kv == geometry


def test_flash_attention_with_two_heads_is_kv_outermost():
    """[[2, 2, D]] with 2 heads: vLLM's FlashAttention / FlashInfer order (K/V outermost)."""
    fmt = RowFormat.of([[2, 2, 4]])
    assert fmt.kv == (2, 4, 4) and fmt.order is None
    assert RowFormat.of([[2, 2, 4]], (2, 4, 4)).order is None


def test_geometry_is_inferred_only_where_the_view_names_it():
    assert infer_geometry([[4, 8], [4, 8]]) == (4, 8, 8)
    assert infer_geometry([[4, 8], [4, 6]]) == (4, 8, 6)
    assert infer_geometry([[8], [8]]) == (1, 8, 8)
    assert infer_geometry([[2, 4, 8]]) == (4, 8, 8)
    assert infer_geometry([[36]]) == (1, 36, 0)
    assert infer_geometry([[4, 16]]) is None            # [H, D + Dv] or one head of 16
    assert infer_geometry([[3, 5], [2, 4, 3]]) is None  # recurrent state
    native = RowFormat.of([[4, 16]])
    assert (native.kv, native.order, native.canonical) == (None, None, False)
    x = torch.arange(64).view(1, 64)
    assert native.to_cache(x) is x and native.to_bank(x) is x
    assert RowFormat.of([[32]], (2, 8, 8)).kv is None       # the geometry given, the view none of its
    assert RowFormat.of([[3, 5], [2, 4, 3]], (2, 4, 4)).kv is None
    with pytest.raises(ValueError, match=r"layer 'x': KV geometry \(0, 8, 8\) is invalid"):
        RowFormat.of([[2, 16]], (0, 8, 8), where="layer 'x'")
