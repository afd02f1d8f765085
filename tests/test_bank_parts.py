"""Bank parts (bank/parts.py): what one rank of a parallel engine loads
of a canonical bank, and how the ranks' parts come back together.

* TP: a rank's row is the K of its KV heads, then their V (heads replicated
  when there are fewer than ranks; MLA's latent row whole on every rank).
* PP: a stage's layers only.  DCP: a rank's own positions, in local order.
* ``Bank.load(path, part)`` reads the same bytes ``Bank.select(part)`` keeps.
* A rank's part replays into that rank's caches (every GPU layout, both
  backends, poisoned memory): each head holds the recorded K and V of its
  global head; DCP ranks write what the W = 1 engine writes.
* ``record/assemble.py`` merges the rows files of a TP x PP recording back
  into the whole bank; ``connector/bank_checks.py`` sizes and names a rank's part.

Every bank element is distinct (its index + 1, as bf16 bits), so a head, K/V,
layer or position mix-up changes bytes.
"""
import json
import os

import numpy as np
import pytest
import torch
from oracle import poisoned_buffer
from test_fill_layouts import assert_same_bytes

from kvfill.bank import Bank, BankError, BankPart, DcpGeometry, head_range
from kvfill.kernels import CacheGroup, FillEngine, GroupFill
from kvfill.kernels.testing import STANDARD_LAYOUTS, standard_views

LENGTHS = [5, 11, 8]                       # a ragged bank of 24 rows
TOKENS = [[100 + 7 * s + i for i in range(n)] for s, n in enumerate(LENGTHS)]


# ------------------------------------------------------------------ banks
def truth(kv, layer, lengths=LENGTHS):
    """Known distinct K ``[T, H, D]`` and V ``[T, H, Dv]`` of a layer, int16
    bits: element (row, K then V, head, d) holds 1 + its index + a layer offset."""
    h, d, dv = kv
    total = sum(lengths)
    idx = torch.arange(total * h * (d + dv), dtype=torch.int16, device="cpu")  # a bank's rows: host memory
    idx = idx.view(total, h * (d + dv)) + 1 + 8192 * layer
    return idx[:, :h * d].reshape(total, h, d), idx[:, h * d:].reshape(total, h, dv)


def canonical_rows(k, v):
    return torch.cat([k.reshape(len(k), -1), v.reshape(len(v), -1)], dim=1)


def make_bank(kvs, lengths=LENGTHS, tokens=None, own_order_row=24):
    """A whole bank of bf16 rows: ``kvs`` layer -> (H, D, Dv), or None for a
    layer in its cache's own element order (``own_order_row`` elements)."""
    layers = {}
    for i, (name, kv) in enumerate(kvs.items()):
        if kv is None:
            bits = torch.arange(sum(lengths) * own_order_row, dtype=torch.int16, device="cpu")  # a bank: host memory
            bits = bits.view(-1, own_order_row) + 1 + 8192 * i
        else:
            bits = canonical_rows(*truth(kv, i, lengths))
        layers[name] = bits.view(torch.bfloat16)
    return Bank(layers, sequence_lengths=lengths, sequence_tokens=TOKENS if tokens is None else tokens,
                kv={n: g for n, g in kvs.items() if g}, value_dtypes={n: "bfloat16" for n in kvs},
                parts={n: [[own_order_row]] for n, g in kvs.items() if g is None},
                metadata={"model": "m", "block_size": "8"}, source="whole")


def bits(t):
    return t.view(torch.int16)


def assert_same_bank(got: Bank, want: Bank):
    assert sorted(got.layers) == sorted(want.layers)
    for n in want.layers:
        assert got.layers[n].dtype == want.layers[n].dtype, n
        assert torch.equal(bits(got.layers[n]), bits(want.layers[n])), n
    assert (got.lengths, got.recorded_lengths, got.sequence_tokens) == \
           (want.lengths, want.recorded_lengths, want.sequence_tokens)
    assert got.kv == want.kv and got.part == want.part
    assert {n: v for n, v in got.value_dtypes.items() if v} == {n: v for n, v in want.value_dtypes.items() if v}


def saved(bank, tmp_path):
    path = tmp_path / "bank.safetensors"
    bank.save(path)
    return path


# ------------------------------------------------------------------ TP
@pytest.mark.parametrize("d, dv", [(8, 8), (8, 4)])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_a_tp_rank_holds_the_k_of_its_heads_then_their_v(tp, d, dv):
    h = 8
    bank = make_bank({"l0": (h, d, dv), "l1": (h, d, dv)})
    for r in range(tp):
        part = bank.select(BankPart(r, tp))
        lo, hi = r * h // tp, (r + 1) * h // tp
        assert head_range(h, r, tp) == (lo, hi)
        assert part.kv == {"l0": (hi - lo, d, dv), "l1": (hi - lo, d, dv)}
        assert part.lengths == part.recorded_lengths == tuple(LENGTHS) and part.sequence_tokens == bank.sequence_tokens
        for i, name in enumerate(("l0", "l1")):
            k, v = truth((h, d, dv), i)
            assert torch.equal(bits(part.layers[name]), canonical_rows(k[:, lo:hi], v[:, lo:hi])), (r, name)


@pytest.mark.parametrize("d, dv", [(8, 8), (8, 4)])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_the_ranks_k_parts_then_v_parts_in_rank_order_rebuild_the_whole_row(tp, d, dv):
    h = 8
    bank = make_bank({"l0": (h, d, dv)})
    parts = [bank.select(BankPart(r, tp)).layers["l0"] for r in range(tp)]
    local = h // tp
    keys = [bits(p)[:, :local * d] for p in parts]
    values = [bits(p)[:, local * d:] for p in parts]
    assert all(v.shape[1] == local * dv for v in values)
    assert torch.equal(torch.cat(keys + values, dim=1), bits(bank.layers["l0"]))


PARTS = {
    "whole": BankPart(),
    "tp1of2": BankPart(1, 2),
    "tp3of8": BankPart(3, 8),
    "pp": BankPart(layers={"l1", "mla"}),
    "tp2of4-pp": BankPart(2, 4, layers={"l0"}),
    "dcp1of2-i4": BankPart(dcp=DcpGeometry(2, 1, 4)),
    "tp1of2-pp-dcp3of4": BankPart(1, 2, layers={"l1", "mla"}, dcp=DcpGeometry(4, 3, 1)),
}


@pytest.mark.parametrize("which", PARTS)
def test_loading_a_part_from_a_file_equals_selecting_it_in_memory(which, tmp_path):
    part = PARTS[which]
    bank = make_bank({"l0": (8, 8, 4), "l1": (8, 8, 8), "mla": (1, 36, 0)})
    loaded = Bank.load(saved(bank, tmp_path), part)
    selected = bank.select(part)
    assert_same_bank(loaded, selected)
    assert loaded.metadata == selected.metadata == {"model": "m", "block_size": "8"}
    heads = 8 // part.tp_size
    want_kv = {"l0": (heads, 8, 4), "l1": (heads, 8, 8), "mla": (1, 36, 0)}
    assert loaded.kv == {n: g for n, g in want_kv.items() if part.wants(n)}


def test_a_part_is_not_saved_as_a_bank_nor_selected_from(tmp_path):
    part = make_bank({"l0": (8, 8, 8)}).select(BankPart(1, 2))
    with pytest.raises(BankError, match=r"whole: a rank's part \(TP rank 1/2\) is not a bank file's whole bank; "
                                        r"save the bank it was selected from"):
        part.save(tmp_path / "p.safetensors")
    assert not os.listdir(tmp_path)
    with pytest.raises(BankError, match=r"is already a part \(TP rank 1/2\); select from a whole bank"):
        part.select(BankPart(0, 2))


def test_the_host_memory_check_counts_only_the_part(tmp_path, monkeypatch):
    """Bank.load(path, part) reads the part's columns and rows: a host with
    room for the part, not the whole bank, loads the part."""
    from kvfill.bank import files

    bank = make_bank({"l0": (8, 8, 8), "l1": (8, 8, 8)})
    path = saved(bank, tmp_path)
    part = BankPart(0, 4, layers={"l1"})
    room = bank.nbytes // 4
    monkeypatch.setattr(files, "free_bytes", lambda device: room)
    assert Bank.load(path, part).nbytes == bank.nbytes // 8
    with pytest.raises(BankError, match=r"whole takes 0\.00 GiB, more than the host's 0\.00 GiB available memory"):
        Bank.load(path)


# ------------------------------------------------------------------ replicated heads, MLA, refusals
@pytest.mark.parametrize("tp", [4, 8])
def test_with_fewer_heads_than_ranks_each_head_is_replicated_on_consecutive_ranks(tp):
    bank = make_bank({"l0": (2, 8, 4)})
    k, v = truth((2, 8, 4), 0)
    for r in range(tp):
        head = r // (tp // 2)
        part = bank.select(BankPart(r, tp))
        assert part.kv == {"l0": (1, 8, 4)}
        assert torch.equal(bits(part.layers["l0"]), canonical_rows(k[:, head:head + 1], v[:, head:head + 1])), r


@pytest.mark.parametrize("kv", [(1, 36, 0), (1, 8, 8)], ids=["mla-latent", "one-kv-head"])
@pytest.mark.parametrize("tp", [2, 8])
def test_a_layer_of_one_head_is_whole_on_every_rank(tp, kv):
    bank = make_bank({"l0": kv})
    for r in range(tp):
        part = bank.select(BankPart(r, tp))
        assert part.kv == {"l0": kv}
        assert torch.equal(bits(part.layers["l0"]), bits(bank.layers["l0"])), r


def test_a_layer_without_kv_geometry_is_whole_at_tp_1_and_refused_above(tmp_path):
    bank = make_bank({"attn": (8, 8, 8), "state": None})
    assert torch.equal(bits(bank.select(BankPart(0, 1)).layers["state"]), bits(bank.layers["state"]))
    assert torch.equal(bits(bank.select(BankPart(0, 2, layers={"attn"})).layers["attn"])[:, :32],
                       bits(bank.layers["attn"])[:, :32])  # a stage without it is not refused
    match = r"layer 'state' holds rows in its cache's own element order \(no K/V geometry\): they cannot be split " \
            r"over tensor parallel size 2"
    with pytest.raises(BankError, match=match):
        bank.select(BankPart(1, 2))
    with pytest.raises(BankError, match=match):
        Bank.load(saved(bank, tmp_path), BankPart(1, 2))


def test_a_part_that_does_not_fit_is_refused_before_a_row_is_read(tmp_path, monkeypatch):
    """``fits`` gets the part's bytes from the file's header (TP rank 1 of 2:
    half of every row); its answer is the error, and no layer is read."""
    bank = make_bank({"l0": (8, 8, 8), "l1": (8, 8, 8)})
    path, asked = saved(bank, tmp_path), []
    part = BankPart(1, 2)
    want = bank.select(part).nbytes
    monkeypatch.setattr(BankPart, "take", lambda *a, **k: pytest.fail("a layer's rows were read"))
    with pytest.raises(BankError, match=r"needs room: the GPU is full"):
        Bank.load(path, part, fits=lambda rows, states: asked.append(rows + states) or "needs room: the GPU is full")
    assert asked == [want]


def test_a_file_whose_kv_does_not_name_its_rows_is_refused_before_a_part_is_cut(tmp_path):
    """Cut by a wrong geometry, a part would hold other heads' bytes: refused, naming both sizes."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = saved(make_bank({"l0": (2, 4, 4)}), tmp_path)
    with safe_open(path, framework="pt") as f:
        meta, rows = f.metadata(), f.get_tensor("l0")
    layers = json.loads(meta["layers"])
    layers["l0"]["kv"] = [2, 4, 6]  # names 20 elements; the rows have 16
    save_file({"l0": rows}, path, metadata={**meta, "layers": json.dumps(layers)})
    with pytest.raises(BankError, match=r"layer 'l0' rows have 16 elements, its kv \[2, 4, 6\] names 20"):
        Bank.load(path, BankPart(0, 2))


def test_a_one_head_layer_in_its_caches_own_order_is_whole_on_every_rank(tmp_path):
    """MLA's fp8-packed latent (no K/V view kvfill knows): every TP rank caches
    it whole, so a rank whose part names it in ``whole_layers`` loads it whole."""
    bank = make_bank({"attn": (8, 8, 8), "mla_packed": None})
    for rank in range(4):
        part = BankPart(rank, 4, whole_layers={"mla_packed"})
        for got in (bank.select(part), Bank.load(saved(bank, tmp_path), part)):
            assert torch.equal(bits(got.layers["mla_packed"]), bits(bank.layers["mla_packed"]))
            assert got.layers["attn"].shape[1] == 2 * 8 * 2  # the other layer still split: 2 of 8 heads


@pytest.mark.needs_vllm
def test_a_recorder_reads_a_64k_token_prompt_one_layer_at_a_time(monkeypatch):
    """A completed prompt's rows leave the caches one layer at a time, each
    moved to host memory before the next is read: what the caches' device
    holds at once is one layer's rows and their reordered copy, whatever
    the prompt's length and layer count (issue 52: a 128k prompt of an 8B
    model read whole took ~16 GiB beside vLLM's KV cache).  The rows saved
    are the bytes an all-layers read gives, in the bank's order."""
    from kvfill.connector.recorder import Recorder
    from kvfill.kernels import CacheGroup, FillEngine
    from kvfill.kernels.testing import standard_views

    blocks, block, heads, head, layers = 4096, 16, 2, 8, 3  # 65536 positions; 64 B a row, 4 MiB a layer
    _, views = standard_views(layers, blocks, heads, block, 2 * head, torch.bfloat16, "LBNHC")
    engine = FillEngine({"g": CacheGroup({f"layer.{i}": v for i, v in enumerate(views)}, kv=(heads, head, head))},
                        mean=0.0, std=1.0, seed=3)
    plan = engine.whole_plan()
    engine.fill(plan)
    formats = engine.row_formats()
    assert all(f.order is not None for f in formats.values())  # the bank's order differs: a reordered copy
    whole = engine.read(plan)
    reads = []
    real_read = FillEngine.read

    def read(self, plan, layers=None):
        got = real_read(self, plan, layers)
        reads.append({name: r.numel() * r.element_size() for name, r in got.items()})
        return got

    monkeypatch.setattr(FillEngine, "read", read)
    rows = Recorder._rows(engine, plan, formats)
    one_layer = blocks * block * heads * 2 * head * 2
    assert [list(r) for r in reads] == [[f"layer.{i}"] for i in range(layers)], reads
    assert max(sum(r.values()) for r in reads) == one_layer == 4 << 20
    assert sorted(rows) == sorted(whole) and all(r.device.type == "cpu" for r in rows.values())
    for name, r in rows.items():
        assert r.shape == (blocks * block, 2 * heads * head)
        assert torch.equal(r.view(torch.int16), formats[name].to_bank(whole[name]).view(torch.int16)), name


@pytest.mark.needs_vllm
def test_a_recording_tp_rank_merges_heads_only_of_the_layers_it_read(tmp_path):
    """The recorder names the heads of the layers whose rows it read: a layer
    of no K/V geometry is refused under TP > 1 unless the model is MLA (its
    latent whole on every rank, saved by rank 0)."""
    from types import SimpleNamespace

    from kvfill.connector.options import FillOptions
    from kvfill.connector.recorder import Recorder
    from kvfill.bank import RowFormat

    def recorder(tp_rank, total, use_mla=False):
        par = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1, decode_context_parallel_size=1)
        model = SimpleNamespace(use_mla=use_mla, get_total_num_kv_heads=lambda: total)
        options = FillOptions.from_extra_config({"record_dir": str(tmp_path), "record_positions": 8})
        return Recorder(options, SimpleNamespace(parallel_config=par, model_config=model), tp_rank, 0)

    attn, packed = RowFormat.of([[4, 8], [4, 8]]), RowFormat.of([[4, 164]])  # no geometry named
    assert recorder(1, 8)._heads({"attn": attn}) == {"attn": [4, 8, 8]}
    with pytest.raises(ValueError, match=r"layer 'packed' has no K/V geometry .* tensor parallel size 2"):
        recorder(0, 8)._heads({"attn": attn, "packed": packed})
    mla = recorder(0, 128, use_mla=True)
    assert mla._heads({"packed": packed}) == {} and mla.saves and mla.files_per_prompt == 1
    assert not recorder(1, 128, use_mla=True).saves


@pytest.mark.parametrize("heads, tp, match", [
    (6, 4, r"layer 'l0': 6 KV heads cannot be split over tensor parallel size 4; expected a size dividing 6"),
    (2, 3, r"layer 'l0': 2 KV heads cannot be replicated over tensor parallel size 3; expected a multiple of 2"),
])
def test_heads_that_do_not_divide_over_the_ranks_are_refused_naming_both_sizes(heads, tp, match, tmp_path):
    bank = make_bank({"l0": (heads, 4, 4)})
    with pytest.raises(BankError, match=match):
        bank.select(BankPart(0, tp))
    with pytest.raises(BankError, match=match):
        Bank.load(saved(bank, tmp_path), BankPart(0, tp))


@pytest.mark.parametrize("rank, size", [(2, 2), (-1, 2), (0, 0), (True, 2)])
def test_an_invalid_tp_rank_is_refused(rank, size):
    with pytest.raises(ValueError, match=rf"tensor parallel rank {rank!r} of size {size!r} is invalid"):
        BankPart(rank, size)


# ------------------------------------------------------------------ PP
def test_a_pipeline_stage_loads_only_its_layers_and_every_sequence(tmp_path):
    kvs = {f"model.layers.{i}.attn": (4, 8, 8) for i in range(4)}
    bank = make_bank(kvs)
    stage = {"model.layers.2.attn", "model.layers.3.attn"}
    for part in (bank.select(BankPart(layers=stage)), Bank.load(saved(bank, tmp_path), BankPart(layers=stage))):
        assert sorted(part.layers) == sorted(stage) and sorted(part.kv) == sorted(stage)
        assert sorted(n for n, v in part.value_dtypes.items() if v) == sorted(stage)
        for n in stage:
            assert torch.equal(bits(part.layers[n]), bits(bank.layers[n])), n
        assert part.lengths == part.recorded_lengths == tuple(LENGTHS)
        assert part.sequence_tokens == bank.sequence_tokens and part.num_rows == bank.num_rows
        assert part.sequence_table().tolist() == bank.sequence_table().tolist()


# ------------------------------------------------------------------ DCP
DCP_LENGTHS = [37, 9, 2]
DCP_TOKENS = [list(range(n)) for n in DCP_LENGTHS]


@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize("world", [2, 4])
def test_dcp_ranks_rows_placed_at_their_global_positions_rebuild_every_sequence(world, interleave):
    bank = make_bank({"l0": (2, 4, 4)}, lengths=DCP_LENGTHS, tokens=DCP_TOKENS)
    whole = bits(bank.layers["l0"])
    starts = np.cumsum([0] + DCP_LENGTHS[:-1])
    rebuilt = [torch.zeros(n, whole.shape[1], dtype=torch.int16, device="cpu") for n in DCP_LENGTHS]  # as the bank
    times = [np.zeros(n, np.int64) for n in DCP_LENGTHS]
    for r in range(world):
        dcp = DcpGeometry(world, r, interleave)
        part = bank.select(BankPart(dcp=dcp))
        rows = bits(part.layers["l0"])
        assert part.recorded_lengths == tuple(DCP_LENGTHS) and part.sequence_tokens == bank.sequence_tokens
        assert part.kv == bank.kv
        for s, n in enumerate(DCP_LENGTHS):
            mine = int(dcp.local_count(n))
            local = rows[part.starts[s]:part.starts[s] + part.lengths[s]]
            if mine:
                assert part.lengths[s] == mine, (r, s)
                positions = dcp.global_positions(np.arange(mine))
                assert positions.max() < n
                rebuilt[s][torch.from_numpy(positions)] = local
                np.add.at(times[s], positions, 1)
            else:  # none of the sequence: the I rows W = 1 gives this rank's first I slots
                assert part.lengths[s] == interleave, (r, s)
                positions = dcp.global_positions(np.arange(interleave)) % n
                assert torch.equal(local, whole[starts[s] + torch.from_numpy(positions)]), (r, s)
    for s, n in enumerate(DCP_LENGTHS):
        assert times[s].tolist() == [1] * n, f"sequence {s}: positions held {times[s].tolist()} times"
        assert torch.equal(rebuilt[s], whole[starts[s]:starts[s] + n]), s


# ------------------------------------------------------------------ TP fill: the GPU layouts
NB, N = 6, 8  # manager blocks, slots per block
FILL_LAYERS = ("l0", "l1")
# (block, slot_start, slot_end, local_base, sequence): positions past a sequence's length wrap.
REPLAY_ENTRIES = [(4, 3, 8, 0, 0), (1, 0, 8, 8, 1), (5, 0, 2, 16, 2), (0, 0, 8, 0, 2)]


class Layout:
    """A GPU cache layout of 2 layers for ``h`` heads of K ``d`` / V ``dv``:
    ``make`` builds the registered tensors over a buffer, ``kv(tensor, d,
    block, slot)`` gives that token's K ``[h, d]`` and V ``[h, dv]`` as views,
    by the layout's own indexing (the zoo of kvfill.kernels.testing, any head count)."""

    def __init__(self, name, make, kv, nbytes, block_dim=0, slot_dim=2, needs_kv=False, same_dv=True):
        self.name, self.make, self.kv, self.nbytes = name, make, kv, nbytes
        self.block_dim, self.slot_dim, self.needs_kv, self.same_dv = block_dim, slot_dim, needs_kv, same_dv

    def group(self, layers, kv, **kw):
        return CacheGroup(layers, num_blocks=NB, block_dim=self.block_dim, slot_dim=self.slot_dim,
                          kv=kv if self.needs_kv else None, **kw)

    def __repr__(self):
        return self.name


def _dense_nbytes(h, d, dv, pad=0):
    return len(FILL_LAYERS) * NB * (N * h * (d + dv) + pad) * 2


def _std(order, split=1):
    def make(buf, h, d, dv):
        _, views = standard_views(len(FILL_LAYERS), NB * split, h, N // split, d + dv, torch.bfloat16, order, raw=buf)
        return dict(zip(FILL_LAYERS, views))

    def kv(t, d, b, s):
        kb, ks = b * split + s // (N // split), s % (N // split)
        return t[kb, :, ks, :d], t[kb, :, ks, d:]
    return make, kv


PAD = 32  # elements after each block's page


def _padded_make(buf, h, d, dv):
    c = d + dv
    stride = h * N * c + PAD
    t = buf.view(torch.bfloat16)
    return {n: t.as_strided((NB, h, N, c), (stride, c, h * c, 1), i * NB * stride) for i, n in enumerate(FILL_LAYERS)}


def _split(buf, shape):
    n = int(np.prod(shape))
    t = buf.view(torch.bfloat16)
    return {name: t[i * n:(i + 1) * n].view(*shape) for i, name in enumerate(FILL_LAYERS)}


def _hnd_kv(t, d, b, s):
    stored = t.permute(0, 1, 3, 2, 4)  # the (B, 2, H, N, D) it is stored as
    assert stored.is_contiguous()
    return stored[b, 0, :, s], stored[b, 1, :, s]


LAYOUTS = {lay.name: lay for lay in [
    *[Layout(f"std-{o}", *_std(o), _dense_nbytes, needs_kv=True, same_dv=False) for o in STANDARD_LAYOUTS],
    Layout("std-LBNHC-kernel-split2", *_std("LBNHC", 2), _dense_nbytes, needs_kv=True, same_dv=False),
    Layout("std-LBNHC-padded", _padded_make, _std("LBNHC")[1], lambda h, d, dv: _dense_nbytes(h, d, dv, PAD),
           needs_kv=True, same_dv=False),
    Layout("flash-attn", lambda buf, h, d, dv: _split(buf, (2, NB, N, h, d)),
           lambda t, d, b, s: (t[0, b, s], t[1, b, s]), _dense_nbytes, block_dim=1),
    Layout("flash-attn-kernel-split2", lambda buf, h, d, dv: _split(buf, (2, 2 * NB, N // 2, h, d)),
           lambda t, d, b, s: (t[0, 2 * b + s // (N // 2), s % (N // 2)], t[1, 2 * b + s // (N // 2), s % (N // 2)]),
           _dense_nbytes, block_dim=1),
    Layout("flashinfer-nhd", lambda buf, h, d, dv: _split(buf, (NB, 2, N, h, d)),
           lambda t, d, b, s: (t[b, 0, s], t[b, 1, s]), _dense_nbytes),
    Layout("flashinfer-hnd", lambda buf, h, d, dv: {n: t.permute(0, 1, 3, 2, 4)
                                                   for n, t in _split(buf, (NB, 2, h, N, d)).items()},
           _hnd_kv, _dense_nbytes),
]}
TP_CASES = [(name, 4, 4) for name in LAYOUTS] + [(name, 8, 4) for name in ("std-LBNHC", "std-BHLNC")]


def fill_rank(bank, layout, heads, d, dv, seed, backend, lo=0, plan_entries=REPLAY_ENTRIES):
    """Fill a rank's poisoned caches of ``heads`` heads from ``bank``; check
    every byte against the oracle (local head h holds global head lo + h of
    the recorded row) and head by head; returns the engine, caches and plan."""
    buf = poisoned_buffer(layout.nbytes(heads, d, dv), seed=seed)
    expected = buf.clone()
    layers = layout.make(buf, heads, d, dv)
    eng = FillEngine({"g": layout.group(layers, (heads, d, dv))}, bank=bank, backend=backend)
    plan = {"g": GroupFill(*zip(*plan_entries))}
    eng.fill(plan)
    want = layout.make(expected, heads, d, dv)
    starts = np.cumsum([0] + LENGTHS[:-1])
    for li, name in enumerate(FILL_LAYERS):
        k_true, v_true = truth((8, d, dv), li)
        for b, s0, s1, base, q in plan_entries:
            for s in range(s0, s1):
                row = starts[q] + (base + s) % LENGTHS[q]
                k, v = layout.kv(want[name], d, b, s)
                bits(k).copy_(k_true[row, lo:lo + heads])
                bits(v).copy_(v_true[row, lo:lo + heads])
                got_k, got_v = layout.kv(layers[name], d, b, s)
                for h in range(heads):  # the bank's rows are host memory, the caches the device's
                    assert torch.equal(bits(got_k[h]), k_true[row, lo + h].to(got_k.device)), (name, b, s, "K", h)
                    assert torch.equal(bits(got_v[h]), v_true[row, lo + h].to(got_v.device)), (name, b, s, "V", h)
    assert_same_bytes(buf, expected)
    return eng, layers, plan


@pytest.mark.parametrize("dst, d, dv", TP_CASES, ids=[f"{n}-d{d}-dv{dv}" for n, d, dv in TP_CASES])
def test_each_tp_rank_fills_its_heads_of_the_recorded_k_and_v_into_every_gpu_layout(dst, d, dv, backend):
    bank = make_bank({n: (8, d, dv) for n in FILL_LAYERS})
    for r in range(2):
        part = bank.select(BankPart(r, 2))
        eng, layers, plan = fill_rank(part, LAYOUTS[dst], 4, d, dv, seed=70 + r, backend=backend, lo=4 * r)
        assert eng.verify(plan).ok


@pytest.mark.parametrize("dst", ["std-LBNHC", "flash-attn", "flashinfer-hnd"])
def test_verify_finds_one_flipped_byte_in_a_rank_filled_slot(dst, backend):
    bank = make_bank({n: (8, 4, 4) for n in FILL_LAYERS})
    eng, layers, plan = fill_rank(bank.select(BankPart(1, 2)), LAYOUTS[dst], 4, 4, 4, seed=80, backend=backend, lo=4)
    _, v = LAYOUTS[dst].kv(layers["l1"], 4, 1, 3)   # block 1 slot 3: sequence 1, position 11 -> row 0 of it
    v.view(torch.uint8)[2, 1] ^= 0x40               # a byte of V, local head 2
    report = eng.verify(plan)
    assert not report.ok and report.num_mismatched == 1
    assert (report.first[0].block, report.first[0].slot) == (1, 3)


@pytest.mark.parametrize("dst", ["std-LBNHC", "flash-attn"])
def test_a_whole_bank_into_a_ranks_caches_is_refused_suggesting_the_ranks_part(dst):
    bank = make_bank({n: (8, 4, 4) for n in FILL_LAYERS})
    layout = LAYOUTS[dst]
    buf = poisoned_buffer(layout.nbytes(4, 4, 4), seed=90)
    poison = buf.clone()
    layers = layout.make(buf, 4, 4, 4)
    with pytest.raises(BankError, match=r"whole: layer 'l0' was recorded with \[8, 4, 4\] \(heads, head_size, "
                                        r"head_size_v\), the cache holds \[4, 4, 4\]: a tensor-parallel rank's heads; "
                                        r"load the rank's part \(Bank\.load\(path, BankPart\(tp_rank, tp_size\)\)\)"):
        FillEngine({"g": layout.group(layers, (4, 4, 4))}, bank=bank)
    assert torch.equal(buf, poison)


def test_a_part_of_another_tp_size_is_refused_as_another_head_layout():
    bank = make_bank({n: (8, 4, 4) for n in FILL_LAYERS}).select(BankPart(0, 4))  # 2 heads a rank
    layout = LAYOUTS["flash-attn"]
    buf = poisoned_buffer(layout.nbytes(4, 4, 4), seed=91)
    poison = buf.clone()
    with pytest.raises(BankError, match=r"recorded with \[2, 4, 4\] .* the cache holds \[4, 4, 4\]: another model "
                                        r"or head layout"):
        FillEngine({"g": layout.group(layout.make(buf, 4, 4, 4), (4, 4, 4))}, bank=bank)
    assert torch.equal(buf, poison)


# ------------------------------------------------------------------ DCP fill
DCP_NB = 8
REQUEST = [40, 12, 8]                               # tokens each sequence's request replays: past N_s they wrap
TABLES = [[3, 0, 5, 1, 7], [2, 6], [4]]             # its blocks, in local order


def dcp_entries(dcp):
    """A rank's plan: the local slots [0, local_count(M_s)) of each request's tokens."""
    out = []
    for s, (m, table) in enumerate(zip(REQUEST, TABLES)):
        count = int(dcp.local_count(m))
        out += [(table[k], 0, min(N, count - k * N), k * N, s) for k in range(-(-count // N))]
    return out


def dcp_fill(bank, dcp, seed, backend):
    """A rank's caches (std-LBNHC, 2 heads x 4, poisoned) filled from ``bank``,
    checked byte for byte: local slot l of sequence s holds row
    ``l mod L_s`` of the rank's rows, the row of position
    ``global_positions(l mod L_s) mod N_s`` (L_s: the rank's local length)."""
    kv = _std("LBNHC")[1]
    buf = poisoned_buffer(len(FILL_LAYERS) * DCP_NB * N * 2 * 8 * 2, seed=seed)
    expected = buf.clone()
    _, views = standard_views(2, DCP_NB, 2, N, 8, torch.bfloat16, "LBNHC", raw=buf)
    eng = FillEngine({"g": CacheGroup(dict(zip(FILL_LAYERS, views)), slot_dim=2, kv=(2, 4, 4), dcp=dcp)},
                     bank=bank, backend=backend)
    entries = dcp_entries(dcp)
    plan = {"g": GroupFill(*zip(*entries))}
    eng.fill(plan)
    _, want = standard_views(2, DCP_NB, 2, N, 8, torch.bfloat16, "LBNHC", raw=expected)
    starts = np.cumsum([0] + DCP_LENGTHS[:-1])
    for li, name in enumerate(FILL_LAYERS):
        rows = canonical_rows(*truth((2, 4, 4), li, DCP_LENGTHS))
        for b, s0, s1, base, q in entries:
            n = DCP_LENGTHS[q]
            held = int(dcp.local_count(n)) or dcp.interleave
            for s in range(s0, s1):
                position = int(dcp.global_positions((base + s) % held)) % n
                k, v = kv(want[li], 4, b, s)
                k.view(torch.int16).copy_(rows[starts[q] + position, :8].view(2, 4))
                v.view(torch.int16).copy_(rows[starts[q] + position, 8:].view(2, 4))
    assert_same_bytes(buf, expected)
    assert eng.verify(plan).ok
    return buf, dict(zip(FILL_LAYERS, views))


@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize("world", [2, 4])
def test_a_dcp_rank_fills_from_its_loaded_part_what_it_fills_from_the_whole_bank(world, interleave, backend,
                                                                                 tmp_path):
    bank = make_bank({n: (2, 4, 4) for n in FILL_LAYERS}, lengths=DCP_LENGTHS, tokens=DCP_TOKENS)
    path = saved(bank, tmp_path)
    _, ref = dcp_fill(bank, DcpGeometry(), seed=100, backend=backend)
    for r in range(world):
        dcp = DcpGeometry(world, r, interleave)
        loaded, caches = dcp_fill(Bank.load(path, BankPart(dcp=dcp)), dcp, seed=101 + r, backend=backend)
        localized, _ = dcp_fill(bank, dcp, seed=101 + r, backend=backend)  # the Registry selects the rank's rows
        assert torch.equal(loaded, localized), f"rank {r}"
        for s, (n, table) in enumerate(zip(DCP_LENGTHS, TABLES)):
            for t in range(min(n, REQUEST[s])):
                if (t // interleave) % world != r:
                    continue
                loc = (t // (interleave * world)) * interleave + t % interleave
                for name in FILL_LAYERS:
                    got = caches[name][table[loc // N], :, loc % N]
                    want = ref[name][table[t // N], :, t % N]
                    assert torch.equal(bits(got), bits(want)), f"sequence {s} token {t} on rank {r} (local {loc})"


def test_a_dcp_part_for_another_rank_is_refused_naming_both():
    bank = make_bank({n: (2, 4, 4) for n in FILL_LAYERS}, lengths=DCP_LENGTHS, tokens=DCP_TOKENS)
    part = bank.select(BankPart(dcp=DcpGeometry(2, 0, 1)))
    buf = poisoned_buffer(len(FILL_LAYERS) * DCP_NB * N * 2 * 8 * 2, seed=110)
    poison = buf.clone()
    _, views = standard_views(2, DCP_NB, 2, N, 8, torch.bfloat16, "LBNHC", raw=buf)
    with pytest.raises(BankError, match=r"whole: loaded for DCP rank 0/2 \(interleave 1\), the caches are DCP rank 1 "
                                        r"of 2 \(interleave 1\); load the part of these caches' rank"):
        FillEngine({"g": CacheGroup(dict(zip(FILL_LAYERS, views)), slot_dim=2, kv=(2, 4, 4),
                                    dcp=DcpGeometry(2, 1, 1))}, bank=part)
    assert torch.equal(buf, poison)


# ------------------------------------------------------------------ record/assemble.py
ASM_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
ASM_LENGTHS = [5, 3, 7]
ASM_TOKENS = [[11 * s + i for i in range(n)] for s, n in enumerate(ASM_LENGTHS)]


def write_rows_files(work, bank, tp, pp, kv=(8, 8, 4), drop=()):
    """The files a TP x PP recording leaves (connector/recorder.py): per
    prompt and saving rank, its stage's layers, its heads' K then V; the
    first rank of each replicated head's group saves it.  ``drop``: (prompt,
    tp_rank, pp_rank, layer) left out of a file."""
    from safetensors.torch import save_file

    from kvfill.record.assemble import rows_path

    h, d, dv = kv
    replicas = max(1, tp // h)
    stages = np.array_split(np.array(ASM_LAYERS), pp)
    for r in range(0, tp, replicas):
        for p, stage in enumerate(stages):
            part = bank.select(BankPart(r, tp, layers=set(stage)))
            lo, hi = head_range(h, r, tp)
            for q, tokens in enumerate(ASM_TOKENS):
                a = part.starts[q]
                rows = {n: part.layers[n][a:a + ASM_LENGTHS[q]].contiguous() for n in stage
                        if (q, r, p, n) not in drop}
                meta = {"key": "k", "positions": str(ASM_LENGTHS[q]),
                        "heads": json.dumps({n: [lo, hi, h] for n in rows}), "tp_rank": str(r), "pp_rank": str(p),
                        "files_per_prompt": str(pp * (tp // replicas)),
                        "value_dtypes": json.dumps({n: "bfloat16" for n in stage}),
                        "layers": json.dumps({n: {"kv": [hi - lo, d, dv], "parts": [[hi - lo, d], [hi - lo, dv]]}
                                              for n in stage})}
                save_file(rows, rows_path(str(work), tokens, r, p), metadata=meta)


def asm_bank(kv=(8, 8, 4)):
    return make_bank({n: kv for n in ASM_LAYERS}, lengths=ASM_LENGTHS, tokens=ASM_TOKENS)


@pytest.mark.parametrize("kv, tp, pp", [((8, 8, 4), 2, 2), ((2, 8, 8), 4, 1), ((8, 8, 8), 8, 2)],
                         ids=["8heads-tp2-pp2", "2heads-replicated-tp4", "8heads-tp8-pp2"])
def test_the_rows_files_of_a_tp_pp_recording_assemble_into_the_whole_bank(kv, tp, pp, tmp_path):
    from kvfill.record.assemble import assemble

    bank = asm_bank(kv)
    write_rows_files(tmp_path, bank, tp, pp, kv)
    got = assemble(str(tmp_path), ASM_TOKENS, {"model": "m"}, "out")
    for n in ASM_LAYERS:
        assert got.layers[n].dtype == torch.bfloat16
        assert torch.equal(bits(got.layers[n]), bits(bank.layers[n])), n
    assert got.kv == {n: kv for n in ASM_LAYERS}
    assert got.lengths == tuple(ASM_LENGTHS) and got.sequence_tokens == tuple(map(tuple, ASM_TOKENS))
    assert got.value_dtypes == {n: "bfloat16" for n in ASM_LAYERS} and got.source == "out"
    assert got.metadata == {"model": "m", "dtype": "bfloat16"}


def test_a_missing_rank_file_is_refused_naming_the_files(tmp_path):
    from kvfill.record.assemble import assemble, rows_path

    write_rows_files(tmp_path, asm_bank(), 2, 2)
    os.unlink(rows_path(str(tmp_path), ASM_TOKENS[1], 1, 1))
    with pytest.raises(RuntimeError, match=r"a prompt of 3 tokens has 3 rows files \(\[.*\.tp0-pp0\.safetensors', "
                                           r".*\.tp0-pp1\.safetensors', .*\.tp1-pp0\.safetensors'\]\); its workers "
                                           r"expected 4: a worker's rows are missing"):
        assemble(str(tmp_path), ASM_TOKENS, {}, "out")


@pytest.mark.parametrize("heads, ranges", [([0, 4, 8], r"\[\(0, 4\), \(0, 4\)\]"),
                                           ([6, 8, 8], r"\[\(0, 4\), \(6, 8\)\]")], ids=["twice", "missing"])
def test_a_head_range_saved_twice_or_missing_is_refused_naming_the_ranges(heads, ranges, tmp_path):
    """TP rank 1's file of prompt 0 names heads [0, 4) again (or [6, 8): heads 4, 5 nowhere)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kvfill.record.assemble import assemble, rows_path

    write_rows_files(tmp_path, asm_bank(), 2, 2)
    path = rows_path(str(tmp_path), ASM_TOKENS[0], 1, 0)
    with safe_open(path, framework="pt") as f:
        meta, rows = f.metadata(), {n: f.get_tensor(n) for n in f.keys()}
    meta["heads"] = json.dumps({n: heads for n in json.loads(meta["heads"])})
    save_file({n: t[:, :(heads[1] - heads[0]) * 8].contiguous() if heads[1] - heads[0] != 4 else t
               for n, t in rows.items()}, path, metadata=meta)
    with pytest.raises(RuntimeError, match=r"layer 'model\.layers\.[01]\.self_attn\.attn' arrived with KV heads "
                                           + ranges + r" of 8; expected each of \[0, 8\) exactly once"):
        assemble(str(tmp_path), ASM_TOKENS, {}, "out")


def test_a_prompt_missing_a_layer_another_prompt_has_is_refused(tmp_path):
    from kvfill.record.assemble import assemble

    gone = ASM_LAYERS[3]
    write_rows_files(tmp_path, asm_bank(), 2, 2, drop={(2, r, 1, gone) for r in range(2)})
    with pytest.raises(RuntimeError, match=r"a prompt of 7 tokens was recorded with layers .*, an earlier one with "
                                           r".*: every prompt needs every layer"):
        assemble(str(tmp_path), ASM_TOKENS, {}, "out")


# ------------------------------------------------------------------ connector/bank_checks.py (vLLM)
@pytest.mark.needs_vllm
def test_rank_part_is_the_replaying_groups_layers_heads_and_dcp_geometry():
    from kvfill.connector.bank_checks import rank_part

    t = torch.zeros(2, 2, 8, 8)
    dcp = DcpGeometry(4, 1, 2)
    groups = {"full": CacheGroup({"a.0": t, "a.1": t}, dcp=dcp),
              "sliding": CacheGroup({"a.2": t}, dcp=dcp),
              "mamba": CacheGroup({"m.3": [t]}, mode="zero")}
    part = rank_part(groups, 3, 4)
    assert part == BankPart(3, 4, frozenset({"a.0", "a.1", "a.2"}), dcp)
    plain = rank_part({"full": CacheGroup({"a.0": t}), "mamba": CacheGroup({"m.3": [t]}, mode="zero")}, 0, 1)
    assert plain == BankPart(0, 1, frozenset({"a.0"}))
    assert not plain.dcp.sharded and plain.wants("a.0") and not plain.wants("m.3")


@pytest.mark.parametrize("heads, d, dv, tp, pp, dcp", [(8, 16, 16, 2, 1, 1), (8, 16, 16, 4, 2, 2),
                                                        (2, 16, 16, 4, 1, 1), (1, 36, 0, 4, 1, 4)])
def test_bank_memory_tables_per_rank_bytes_are_what_the_largest_rank_loads(heads, d, dv, tp, pp, dcp):
    """``bench/bank_memory.py``'s formula (the README's memory table) against
    the loader: the most any rank's part holds of a bank of that shape."""
    from kvfill.bench.bank_memory import ModelKV, rank_bytes

    layers, sequences, positions = 4, 2, 37
    bank = Bank({f"l{i}": torch.zeros(sequences * positions, heads * (d + dv), dtype=torch.bfloat16)
                 for i in range(layers)}, sequence_lengths=[positions] * sequences,
                kv={f"l{i}": (heads, d, dv) for i in range(layers)})
    stages = [{f"l{i}" for i in range(s * layers // pp, (s + 1) * layers // pp)} for s in range(pp)]
    most = max(bank.select(BankPart(r, tp, stage, DcpGeometry(dcp, r % dcp, 1) if dcp > 1 else DcpGeometry())).nbytes
               for r in range(tp) for stage in stages)
    assert rank_bytes(ModelKV("m", layers, heads, d, dv), sequences, positions, tp, pp, dcp) == most


@pytest.mark.needs_vllm
@pytest.mark.parametrize("heads, tp", [(8, 8), (2, 4)])
def test_a_rank_whose_caches_hold_one_of_several_heads_loads_only_that_head(heads, tp, tmp_path):
    """At TP >= H each rank's caches hold one KV head, as MLA's do: the part
    ``rank_part`` gives (one-head layers in ``whole_layers``) still cuts a
    canonical layer of H heads to the rank's head; only a layer of no K/V
    geometry is taken whole."""
    from kvfill.connector.bank_checks import rank_part

    bank = make_bank({"l0": (heads, 8, 8)})
    path = saved(bank, tmp_path)
    for rank in range(tp):
        group = CacheGroup({"l0": torch.zeros(2, 2, 8, 8)}, kv={"l0": (1, 8, 8)})
        part = rank_part({"full": group}, rank, tp)
        assert part.whole_layers == {"l0"}
        got = Bank.load(path, part)
        head = rank // (tp // heads)
        assert got.kv["l0"] == (1, 8, 8)
        assert torch.equal(bits(got.layers["l0"]), bits(bank.select(BankPart(rank, tp)).layers["l0"]))
        k, v = truth((heads, 8, 8), 0)
        assert torch.equal(bits(got.layers["l0"]), canonical_rows(k[:, head:head + 1], v[:, head:head + 1]))


# ------------------------------------------------------------------ serving length
def capped_fill(bank, dcp, max_len, seed, backend):
    """A rank's caches filled for requests of ``min(REQUEST_s, max_len)``
    tokens (a server of that max_model_len reaches no further)."""
    buf = poisoned_buffer(len(FILL_LAYERS) * DCP_NB * N * 2 * 8 * 2, seed=seed)
    _, views = standard_views(2, DCP_NB, 2, N, 8, torch.bfloat16, "LBNHC", raw=buf)
    eng = FillEngine({"g": CacheGroup(dict(zip(FILL_LAYERS, views)), slot_dim=2, kv=(2, 4, 4), dcp=dcp)},
                     bank=bank, backend=backend)
    entries = []
    for s, (m, table) in enumerate(zip(REQUEST, TABLES)):
        count = int(dcp.local_count(min(m, max_len)))
        entries += [(table[k], 0, min(N, count - k * N), k * N, s) for k in range(-(-count // N))]
    eng.fill({"g": GroupFill(*zip(*entries))})
    return buf


@pytest.mark.parametrize("dcp", [DcpGeometry(), DcpGeometry(2, 1, 1), DcpGeometry(4, 3, 2)], ids=str)
@pytest.mark.parametrize("max_len", [9, 16, 30])
def test_rows_past_the_serving_max_model_len_are_not_loaded_and_the_fill_is_the_same(dcp, max_len, backend,
                                                                                      tmp_path):
    """A bank recorded longer than the server's max_model_len: the part cut
    at it holds fewer rows (those no request can read), and every position a
    request can have replays the same bytes as from the uncut part."""
    bank = make_bank({n: (2, 4, 4) for n in FILL_LAYERS}, lengths=DCP_LENGTHS, tokens=DCP_TOKENS)
    path = saved(bank, tmp_path)
    full = Bank.load(path, BankPart(dcp=dcp))
    cut = Bank.load(path, BankPart(dcp=dcp, max_positions=max_len))
    assert cut.lengths == tuple(int(dcp.local_count(min(n, max_len))) or dcp.interleave for n in DCP_LENGTHS)
    assert cut.nbytes < full.nbytes and cut.recorded_lengths == full.recorded_lengths
    assert torch.equal(bank.select(BankPart(dcp=dcp, max_positions=max_len)).layers[FILL_LAYERS[0]],
                       cut.layers[FILL_LAYERS[0]])
    assert_same_bytes(capped_fill(cut, dcp, max_len, seed=120, backend=backend),
                      capped_fill(full, dcp, max_len, seed=120, backend=backend))


@pytest.mark.needs_vllm
def test_rank_part_cuts_at_the_serving_max_model_len():
    from kvfill.connector.bank_checks import rank_part

    t = torch.zeros(2, 2, 8, 8)
    part = rank_part({"full": CacheGroup({"a.0": t})}, 0, 1, max_positions=4096)
    assert part.max_positions == 4096 and not part.whole and "positions < 4096" in part.describe()
    with pytest.raises(ValueError, match=r"max_positions 0 is invalid; expected None or an int >= 1"):
        BankPart(max_positions=0)


def rewrite_part(path, rows=None, kv=None):
    """A worker's rows file with its rows converted (``rows``: a dtype) or
    its layers' kv changed, the rest as saved."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path, framework="pt") as f:
        meta, tensors = dict(f.metadata()), {n: f.get_tensor(n) for n in f.keys()}
    if rows is not None:
        tensors = {n: t.to(rows) for n, t in tensors.items()}
    if kv is not None:
        meta["layers"] = json.dumps({n: {**v, "kv": kv} for n, v in json.loads(meta["layers"]).items()})
    save_file(tensors, path, metadata=meta)


@pytest.mark.parametrize("change, expected", [
    (dict(rows=torch.float32), r"layer 'model\.layers\.0\.self_attn\.attn' arrived as torch\.float32 from TP rank 1, "
                               r"PP rank 0 and as torch\.bfloat16 from TP rank 0, PP rank 0; every worker records "
                               r"the same cache dtype"),
    # 4 heads x (4 + 8): the same row width as 4 x (8 + 4), K and V split elsewhere
    (dict(kv=[4, 4, 8]), r"layer 'model\.layers\.0\.self_attn\.attn' arrived with kv \[4, 4, 8\] \(heads, head_size, "
                         r"head_size_v\) from TP rank 1, PP rank 0 and \[4, 8, 4\] from TP rank 0, PP rank 0"),
], ids=["dtype", "geometry"])
def test_parts_that_disagree_on_dtype_or_head_sizes_are_refused_naming_both(change, expected, tmp_path):
    from kvfill.record.assemble import assemble, rows_path

    write_rows_files(tmp_path, asm_bank(), 2, 1)
    rewrite_part(rows_path(str(tmp_path), ASM_TOKENS[1], 1, 0), **change)
    with pytest.raises(RuntimeError, match=expected):
        assemble(str(tmp_path), ASM_TOKENS, {}, "out")


def test_a_prompt_recorded_in_another_dtype_than_an_earlier_one_is_refused(tmp_path):
    from kvfill.record.assemble import assemble, rows_path

    write_rows_files(tmp_path, asm_bank(), 1, 1)
    rewrite_part(rows_path(str(tmp_path), ASM_TOKENS[2], 0, 0), rows=torch.float32)
    with pytest.raises(RuntimeError, match=r"layer 'model\.layers\.0\.self_attn\.attn' arrived as torch\.float32 with "
                                           r"kv \[8, 8, 4\], an earlier prompt's as torch\.bfloat16"):
        assemble(str(tmp_path), ASM_TOKENS, {}, "out")


@pytest.mark.needs_vllm
def test_parts_fetched_through_vllm_from_each_workers_own_disk_assemble_the_shared_folders_bank(tmp_path,
                                                                                                 monkeypatch):
    """Two workers of a TP 2 recording, each with its parts on its own disk
    (standing in for two nodes): fetched through collective_rpc in chunks
    smaller than a part, the bank is byte for byte the one assembled from a
    folder both shared, and each worker's folder is gone afterwards."""
    from types import SimpleNamespace

    from kvfill.connector import recorder as worker_side
    from kvfill.connector.options import FillOptions
    from kvfill.record import transfer
    from kvfill.record.assemble import assemble

    shared = tmp_path / "shared"
    shared.mkdir()
    write_rows_files(shared, asm_bank(), 2, 1)
    par = SimpleNamespace(decode_context_parallel_size=1, tensor_parallel_size=2, pipeline_parallel_size=1)
    cfg = SimpleNamespace(parallel_config=par, model_config=SimpleNamespace(use_mla=False,
                                                                            get_total_num_kv_heads=lambda: 8))
    opts = FillOptions.from_extra_config({"record_dir": str(tmp_path / "work")})
    workers = [worker_side.Recorder(opts, cfg, tp_rank=r, pp_rank=0) for r in range(2)]
    for w in workers:  # each worker's own files, on its own disk
        for f in shared.glob(f"*.tp{w.tp_rank}-pp0.safetensors"):
            with open(os.path.join(w.folder, f.name), "wb") as out:
                out.write(f.read_bytes())
    assert workers[0].folder != workers[1].folder and all(len(w.parts()) == len(ASM_TOKENS) for w in workers)

    class Engine:  # vLLM's collective_rpc: the callable runs in every worker
        calls = 0

        def collective_rpc(self, fn, args=()):
            out = []
            for w in workers:
                monkeypatch.setattr(worker_side, "_this_recorder", lambda w=w: w)
                out.append(fn(None, *args))
            Engine.calls += 1
            return out

    monkeypatch.setattr(transfer, "CHUNK_BYTES", 1000)
    work = tmp_path / "work"
    work.mkdir()
    fetched = transfer.fetch_parts(Engine(), str(work))
    assert fetched == sum(f.stat().st_size for f in shared.iterdir())
    assert Engine.calls > len(ASM_TOKENS) * 2 + 2  # chunked: several reads per part
    for f in shared.iterdir():
        assert (work / f.name).read_bytes() == f.read_bytes(), f.name
    assert not any(os.path.exists(w.folder) for w in workers)
    got, want = assemble(str(work), ASM_TOKENS, {}, "out"), assemble(str(shared), ASM_TOKENS, {}, "out")
    assert set(got.layers) == set(want.layers)
    assert all(torch.equal(got.layers[n].view(torch.int16), want.layers[n].view(torch.int16)) for n in got.layers)
