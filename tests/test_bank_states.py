"""The bank's state section (kvfill/bank/state.py): state tensors cut and
merged over tensor parallelism as vLLM shards them, packed into pages as vLLM
lays them out, saved and loaded (whole and per rank), and written into state
blocks (kvfill/kernels/state_pages.py) with every other byte untouched."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvfill.bank import Bank, BankError, BankPart
from kvfill.bank.state import StateTensor, pack, state_tensor_name, unpack
from kvfill.kernels.state_pages import StatePages, StateWrite

# A gated delta-net layer: 2 key heads and 4 value heads of 8, conv kernel 4 (state_len 3); conv channels
# q (16), k (16), v (32); recurrent state [v_heads, v_dim, k_dim].
K, V = 2 * 8, 4 * 8
GDN = (StateTensor((3, 2 * K + V), torch.bfloat16, 1, (K, K, V)), StateTensor((4, 8, 8), torch.float32, 0))


def _full(layout, s=3, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn((s, *st.shape), generator=g, device="cpu").to(st.dtype) for st in layout]


def _vllm_shard(conv: torch.Tensor, r: int, t: int) -> torch.Tensor:
    """Rank r's conv channels as vLLM's MergedColumnParallelLinear gives them: its q, then its k, then its v."""
    q, k, v = conv[..., :K], conv[..., K:2 * K], conv[..., 2 * K:]
    return torch.cat([x.chunk(t, dim=-1)[r] for x in (q, k, v)], dim=-1)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_state_tensors_are_cut_as_vllm_shards_them_and_merge_back(tp):
    conv, ssm = _full(GDN)
    parts_conv = [GDN[0].take(conv, r, tp) for r in range(tp)]
    parts_ssm = [GDN[1].take(ssm, r, tp) for r in range(tp)]
    for r in range(tp):
        assert torch.equal(parts_conv[r], _vllm_shard(conv, r, tp))
        assert torch.equal(parts_ssm[r], ssm.chunk(tp, dim=1)[r])
        assert tuple(parts_conv[r].shape[1:]) == GDN[0].local_shape(r, tp)
    assert torch.equal(GDN[0].merge(parts_conv), conv)
    assert torch.equal(GDN[1].merge(parts_ssm), ssm)


def test_a_replicated_state_is_whole_on_every_rank_and_must_agree():
    st = StateTensor((2, 6), torch.float32, None)
    x = _full((st,))[0]
    assert torch.equal(st.take(x, 1, 2), x)
    assert torch.equal(st.merge([x, x.clone()]), x)
    with pytest.raises(BankError, match="differs between ranks"):
        st.merge([x, x + 1])


def test_a_segment_tp_cannot_split_is_refused_naming_it():
    with pytest.raises(BankError, match="segment of 16 .* tensor parallel size 3"):
        GDN[0].ranges(0, 3)
    with pytest.raises(BankError, match="segments"):
        StateTensor((3, 10), torch.float32, 1, (4, 4))


class _Layer:
    """Stands in for a vLLM MambaBase layer: its state shapes and dtypes, and
    the byte alignment of each state in its page (vLLM 0.34's
    ``MambaBase.state_alignment``; vLLM 0.32's layers have none: 1)."""

    def __init__(self, shapes, dtypes, state_alignment=1):
        self.shapes, self.dtypes, self.state_alignment = shapes, dtypes, state_alignment

    def get_state_shape(self):
        return self.shapes

    def get_state_dtype(self):
        return self.dtypes


@pytest.mark.needs_vllm
def test_pages_pack_the_states_as_vllm_binds_them():
    """vLLM's own MambaBase.bind_kv_cache reads the states out of the page
    bytes ``pack`` writes (its padding left alone)."""
    import vllm.model_executor.layers.mamba.abstract as mamba
    conv, ssm = _full(GDN)
    layer = _Layer([GDN[0].shape, GDN[1].shape], [GDN[0].dtype, GDN[1].dtype])
    pages = pack([conv, ssm])
    padded = torch.full((3, pages.shape[1] + 64), 0x5A, dtype=torch.int8, device="cpu")  # host, as the states
    padded[:, :pages.shape[1]] = pages.view(torch.int8)
    mamba.MambaBase.bind_kv_cache(layer, padded[:, None, None, :])
    assert torch.equal(layer.kv_cache[0], conv) and torch.equal(layer.kv_cache[1], ssm)
    back = unpack(padded, [GDN[0].shape, GDN[1].shape], [GDN[0].dtype, GDN[1].dtype])
    assert torch.equal(back[0], conv) and torch.equal(back[1], ssm)
    assert (padded[:, pages.shape[1]:] == 0x5A).all()


# ------------------------------------------------------------------ state alignment (vLLM 0.34)
# States whose sizes are no multiple of 16 bytes: a conv state [3, 6] of bf16 (36 B) and a recurrent state
# [2, 3, 3] of float32 (72 B). Packed one after another (alignment 1): offsets 0, 36, 108 bytes in all; at
# vLLM 0.34's FlashInfer ReplaySSM alignment of 16 each starts at and takes a multiple of 16: offsets 0, 48,
# 48 + 80 = 128 bytes in all; at 64: 0, 64, 64 + 128 = 192 (the hand-computed layouts kvfill's are held to).
ODD = (StateTensor((3, 6), torch.bfloat16, 1), StateTensor((2, 3, 3), torch.float32, 0))
HAND = {1: ([0, 36], 108), 16: ([0, 48], 128), 64: ([0, 64], 192)}


def _vllm_aligns_states() -> bool:
    from dataclasses import fields

    from vllm.v1.kv_cache_interface import MambaSpec

    return "state_alignment" in {f.name for f in fields(MambaSpec)}


def _odd_bank(name, states):
    """A bank of three 4-token sequences: one attention layer's rows and ``states`` of ``ODD``."""
    rows = torch.zeros(12, 2 * 2 * 8, dtype=torch.bfloat16)
    return Bank({"model.layers.3.self_attn.attn": rows}, sequence_lengths=[4, 4, 4],
                kv={"model.layers.3.self_attn.attn": (2, 8, 8)}, states={name: states}, state_layouts={name: ODD})


NO_ALIGNMENT = "this vLLM's MambaSpec has no state_alignment (vLLM 0.32: states one after another in a page)"


@pytest.mark.parametrize("alignment", sorted(HAND))
def test_states_sit_at_the_hand_computed_offsets_of_their_alignment_and_unpack_back(alignment):
    """``state_offsets``/``pack``/``unpack`` against the layout worked out by
    hand above: every state's bytes at its offset, the gaps zero."""
    from kvfill.bank.state import state_offsets

    offsets, total = HAND[alignment]
    shapes, dtypes = [st.shape for st in ODD], [st.dtype for st in ODD]
    assert state_offsets(shapes, dtypes, alignment) == (offsets, total)
    conv, ssm = _full(ODD)
    page = pack([conv, ssm], alignment)
    assert page.shape == (3, total) and page.dtype == torch.uint8
    assert torch.equal(page[:, 0:36], conv.view(torch.uint8).reshape(3, -1))
    assert torch.equal(page[:, offsets[1]:offsets[1] + 72], ssm.view(torch.uint8).reshape(3, -1))
    gaps = torch.ones(total, dtype=torch.bool, device="cpu")  # the page is the host states'
    gaps[0:36] = gaps[offsets[1]:offsets[1] + 72] = False
    assert (page[:, gaps] == 0).all()
    # a cache page longer than the states (vLLM's page padding): the states read back, the rest left
    poisoned = torch.full((3, total + 48), 0x5A, dtype=torch.uint8, device="cpu")
    poisoned[:, :total] = page
    back = unpack(poisoned, shapes, dtypes, alignment)
    assert torch.equal(back[0], conv) and torch.equal(back[1], ssm)
    with pytest.raises(BankError, match="cannot hold states"):
        unpack(poisoned[:, :offsets[1] + 71], shapes, dtypes, alignment)


def test_a_state_alignment_below_one_is_refused():
    from kvfill.bank.state import state_offsets

    with pytest.raises(BankError, match="state alignment 0"):
        state_offsets([(2,)], [torch.float32], 0)


@pytest.mark.needs_vllm
@pytest.mark.parametrize("alignment", [1, 16])
def test_aligned_pages_are_vllms_own_page_layout(alignment):
    """vLLM 0.34's own layout: its ``MambaSpec`` content size is the page
    width ``pack`` makes, and its ``MambaBase.bind_kv_cache`` reads each
    state out of the page at the offset kvfill wrote it (poison around, and
    in the bytes past the states)."""
    import vllm.model_executor.layers.mamba.abstract as mamba
    from vllm.v1.kv_cache_interface import MambaSpec

    if alignment > 1 and not _vllm_aligns_states():
        pytest.skip(NO_ALIGNMENT)
    shapes, dtypes = tuple(st.shape for st in ODD), tuple(st.dtype for st in ODD)
    kw = {"state_alignment": alignment} if alignment > 1 else {}
    spec = MambaSpec(block_size=16, shapes=shapes, dtypes=dtypes, **kw)
    conv, ssm = _full(ODD)
    page = pack([conv, ssm], alignment)
    assert page.shape[1] == spec.page_size_bytes == HAND[alignment][1]
    poisoned = torch.full((3, page.shape[1] + 32), 0x5A, dtype=torch.uint8)
    poisoned[:, :page.shape[1]] = page
    layer = _Layer(list(shapes), list(dtypes), alignment)
    mamba.MambaBase.bind_kv_cache(layer, poisoned.view(torch.int8)[:, None, None, :])
    assert torch.equal(layer.kv_cache[0], conv) and torch.equal(layer.kv_cache[1], ssm)
    assert (poisoned[:, page.shape[1]:] == 0x5A).all()


@pytest.mark.needs_vllm
def test_a_recording_reads_each_state_where_vllm_wrote_it_in_an_aligned_page():
    """The recorder's direction: states written through vLLM 0.34's own
    per-state views of an aligned page (poisoned first) are read back by
    ``unpack`` at the alignment the connector takes from the spec
    (``states.state_alignment``), and a bank replays them as the same page."""
    import vllm.model_executor.layers.mamba.abstract as mamba
    from vllm.v1.kv_cache_interface import MambaSpec

    from kvfill.connector.states import state_alignment

    if not _vllm_aligns_states():
        pytest.skip(NO_ALIGNMENT)
    shapes, dtypes = tuple(st.shape for st in ODD), tuple(st.dtype for st in ODD)
    spec = MambaSpec(block_size=16, shapes=shapes, dtypes=dtypes, state_alignment=16)
    assert state_alignment(spec) == 16
    raw = torch.full((3, spec.page_size_bytes), -7, dtype=torch.int8)
    layer = _Layer(list(shapes), list(dtypes), 16)
    mamba.MambaBase.bind_kv_cache(layer, raw[:, None, None, :])
    conv, ssm = _full(ODD, seed=4)
    layer.kv_cache[0].copy_(conv)
    layer.kv_cache[1].copy_(ssm)
    got = unpack(raw, shapes, dtypes, state_alignment(spec))
    assert torch.equal(got[0], conv) and torch.equal(got[1], ssm)
    assert not torch.equal(unpack(raw, shapes, dtypes)[1], ssm)  # read unaligned, the recurrent state is wrong
    name = "model.layers.0.linear_attn"
    bank = _odd_bank(name, got)
    replayed = bank.state_pages(name, shapes, dtypes, state_alignment(spec))
    written = raw.view(torch.uint8).clone()
    written[:, 36:48] = written[:, 120:128] = 0  # the gaps vLLM never writes: zero in kvfill's page
    assert torch.equal(replayed, written)


def test_aligned_state_pages_are_written_whole_with_nothing_else_changed():
    """StatePages over padded pages whose rows are the aligned content (what
    vLLM 0.34 registers: ``state_content_size_bytes`` wide): each block gets
    its sequence's aligned page, the padding and other blocks keep the poison."""
    name = "model.layers.0.linear_attn"
    states = _full(ODD)
    bank = _odd_bank(name, states)
    pages = bank.state_pages(name, [st.shape for st in ODD], [st.dtype for st in ODD], 16)
    assert pages.shape == (3, HAND[16][1])
    raw = torch.full((5, 128 + 48), -7, dtype=torch.int8)
    cache = raw[:, :128].view(5, 1, 1, 128)
    sp = StatePages({name: cache}, {name: pages})
    blocks = {name: (np.array([3, 0]), np.array([1, 2]))}
    assert sp.write(blocks) == StateWrite(pages=2, bytes=2 * 128, launches=3)
    back = unpack(raw[[3, 0], :128].cpu(), [st.shape for st in ODD], [st.dtype for st in ODD], 16)  # host pages
    assert torch.equal(back[0], states[0][[1, 2]]) and torch.equal(back[1], states[1][[1, 2]])
    assert (raw[[1, 2, 4]] == -7).all() and (raw[:, 128:] == -7).all()
    assert sp.mismatches(blocks) == (2, 0, [])
    with pytest.raises(ValueError, match="its pages hold 128 bytes"):  # unaligned pages do not fit aligned rows
        StatePages({name: cache}, {name: bank.state_pages(name, [st.shape for st in ODD], [st.dtype for st in ODD])})


def _bank(s=3, source="bank"):
    lengths = [5, 7, 4][:s]
    g = torch.Generator(device="cpu").manual_seed(1)
    rows = torch.randn(sum(lengths), 2 * 2 * 8, generator=g, device="cpu").to(torch.bfloat16)
    return Bank({"model.layers.3.self_attn.attn": rows}, sequence_lengths=lengths,
                sequence_tokens=[list(range(10 + i, 10 + i + n)) for i, n in enumerate(lengths)],
                kv={"model.layers.3.self_attn.attn": (2, 8, 8)},
                states={"model.layers.0.linear_attn": _full(GDN, s)},
                state_layouts={"model.layers.0.linear_attn": GDN}, source=source)


def test_state_sections_round_trip_through_a_bank_file(tmp_path):
    bank = _bank()
    path = tmp_path / "b.safetensors"
    bank.save(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert meta["version"] == "4"
        assert set(json.loads(meta["states"])) == {"model.layers.0.linear_attn"}
        assert f.get_tensor(state_tensor_name("model.layers.0.linear_attn", 1)).dtype == torch.float32
    back = Bank.load(path)
    for a, b in zip(bank.states["model.layers.0.linear_attn"], back.states["model.layers.0.linear_attn"]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert back.state_layouts == bank.state_layouts
    assert back.nbytes == bank.nbytes and "1 state layers" in back.describe()


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_loads_its_part_of_the_states_and_the_parts_reassemble(tmp_path, tp):
    bank = _bank()
    path = tmp_path / "b.safetensors"
    bank.save(path)
    name = "model.layers.0.linear_attn"
    loaded = [Bank.load(path, BankPart(r, tp)) for r in range(tp)]
    selected = [bank.select(BankPart(r, tp)) for r in range(tp)]
    for i, st in enumerate(GDN):
        for r in range(tp):
            assert torch.equal(loaded[r].states[name][i], selected[r].states[name][i])
        assert torch.equal(st.merge([p.states[name][i] for p in loaded]), bank.states[name][i])
    # the page a rank's cache holds: its local shapes
    shapes = [st.local_shape(1, tp) for st in GDN]
    page = loaded[1].state_pages(name, shapes, [st.dtype for st in GDN])
    assert page.shape == (3, sum(st.local_shape(1, tp)[0] * st.local_shape(1, tp)[1] * (2 if i == 0 else 8 * 4)
                                 for i, st in enumerate(GDN)))


def test_a_tp_rank_asks_fits_for_the_bytes_it_keeps_not_every_state_whole(tmp_path):
    """At TP 4 each rank uploads its rows and its cut of each state tensor:
    the GPU fit check (``fits``) is asked for exactly the bytes of the part
    the rank loads - a quarter of this bank's states, whose every tensor TP
    cuts - not for every state tensor whole."""
    bank = _bank()
    path = tmp_path / "b.safetensors"
    bank.save(path)
    for r in range(4):
        asked = []
        part = Bank.load(path, BankPart(r, 4), fits=lambda rows, states: asked.append((rows, states)))
        assert asked == [(part.row_bytes, part.state_bytes)], (r, asked)
        assert part.state_bytes * 4 == bank.state_bytes


def test_a_pipeline_stage_without_the_state_layer_loads_none(tmp_path):
    path = tmp_path / "b.safetensors"
    _bank().save(path)
    part = Bank.load(path, BankPart(layers=frozenset({"model.layers.3.self_attn.attn"})))
    assert part.states == {} and part.state_layouts == {}


def test_state_pages_of_another_shape_or_dtype_are_refused_naming_both():
    bank = _bank()
    name = "model.layers.0.linear_attn"
    with pytest.raises(BankError, match=r"recorded as .*\[3, 64\].*the cache holds .*\[4, 64\]"):
        bank.state_pages(name, [(4, 64), (4, 8, 8)], [torch.bfloat16, torch.float32])
    with pytest.raises(BankError, match="bfloat16"):
        bank.state_pages(name, [(3, 64), (4, 8, 8)], [torch.bfloat16, torch.bfloat16])
    with pytest.raises(BankError, match="no recorded state for layer 'x'"):
        bank.state_pages("x", [], [])


def test_a_bank_file_whose_state_tensor_lies_about_its_shape_is_refused(tmp_path):
    path = tmp_path / "b.safetensors"
    _bank().save(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    name = state_tensor_name("model.layers.0.linear_attn", 1)
    tensors[name] = tensors[name][:2]
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(BankError, match="one state per sequence"):
        Bank.load(path)


def test_a_version_3_bank_still_reads_with_no_states(tmp_path):
    path = tmp_path / "b.safetensors"
    bank = _bank()
    Bank(bank.layers, sequence_lengths=bank.lengths, sequence_tokens=bank.sequence_tokens, kv=bank.kv).save(path)
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    meta = {k: v for k, v in meta.items() if k not in ("states", "metadata_sha256", "bank_id")}
    meta["version"] = "3"
    save_file(tensors, str(path), metadata=meta)
    old = Bank.load(path)
    assert old.states == {} and torch.equal(old.layers["model.layers.3.self_attn.attn"],
                                            bank.layers["model.layers.3.self_attn.attn"])


def test_state_pages_write_the_recorded_state_into_each_block_and_nothing_else():
    bank = _bank()
    name = "model.layers.0.linear_attn"
    pages = bank.state_pages(name, [st.shape for st in GDN], [st.dtype for st in GDN])
    nbytes = pages.shape[1]
    # vLLM's registered view: [blocks, 1, 1, page bytes] of int8 over padded pages, poisoned
    raw = torch.full((6, nbytes + 32), -7, dtype=torch.int8)
    cache = raw[:, :nbytes].view(6, 1, 1, nbytes)
    sp = StatePages({name: cache}, {name: pages})
    blocks = {name: (np.array([4, 1]), np.array([2, 0]))}
    assert sp.write(blocks) == StateWrite(pages=2, bytes=2 * nbytes, launches=3)
    assert torch.equal(raw[4, :nbytes].view(torch.uint8).cpu(), pages[2])  # the cache on the device, pages host
    assert torch.equal(raw[1, :nbytes].view(torch.uint8).cpu(), pages[0])
    untouched = [b for b in range(6) if b not in (4, 1)]
    assert (raw[untouched] == -7).all() and (raw[:, nbytes:] == -7).all()
    assert sp.mismatches(blocks) == (2, 0, [])
    raw[1, 5] += 1
    checked, bad, first = sp.mismatches(blocks)
    assert (checked, bad) == (2, 1) and first == [(name, 1, 0)]


# A step's state write makes no host sync and no blocking copy: tests/test_device_ledger.py (the stand-in's ledger).


def test_state_pages_refuse_a_bad_block_or_sequence_before_any_write():
    bank = _bank()
    name = "model.layers.0.linear_attn"
    pages = bank.state_pages(name, [st.shape for st in GDN], [st.dtype for st in GDN])
    cache = torch.full((4, 1, 1, pages.shape[1]), 3, dtype=torch.int8)
    sp = StatePages({name: cache, "other": cache.clone()}, {name: pages})
    with pytest.raises(ValueError, match="sequences \\[3\\] outside the bank's 3"):
        sp.write({name: (np.array([1]), np.array([3]))})
    with pytest.raises(ValueError, match="block ids \\[4\\] outside"):
        sp.write({name: (np.array([4]), np.array([0]))})
    assert (cache == 3).all()


@pytest.mark.needs_vllm
def test_the_connector_derives_gdn_and_mamba2_layouts_from_vllm_specs():
    import kvfill.connector.states as specs
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as E
    from vllm.v1.kv_cache_interface import MambaSpec

    tp = 2
    gdn = MambaSpec(block_size=16, shapes=((3, (2 * K + V) // tp), (4 // tp, 8, 8)),
                    dtypes=(torch.bfloat16, torch.float32), mamba_type=E.GDN_ATTN)
    assert specs.state_layout(gdn, tp, dim_first=False) == GDN
    # Mamba-2: 8 heads of 4, 2 groups of state 6: x 32 channels, B and C 12 each
    m2 = MambaSpec(block_size=16, shapes=((3, (32 + 24) // tp), (8 // tp, 4, 6)),
                   dtypes=(torch.bfloat16, torch.bfloat16), mamba_type=E.MAMBA2)
    conv, ssm = specs.state_layout(m2, tp, dim_first=False)
    assert conv == StateTensor((3, 56), torch.bfloat16, 1, (32, 12, 12))
    assert ssm == StateTensor((8, 4, 6), torch.bfloat16, 0, (8,))
    # vLLM's dim-first conv layout: [channels, state_len]
    ds = MambaSpec(block_size=16, shapes=(((2 * K + V) // tp, 3), (4 // tp, 8, 8)),
                   dtypes=(torch.bfloat16, torch.float32), mamba_type=E.GDN_ATTN)
    assert specs.state_layout(ds, tp, dim_first=True)[0] == StateTensor((2 * K + V, 3), torch.bfloat16, 0, (K, K, V))


def test_the_recorder_merges_every_tp_ranks_state_part_and_refuses_a_missing_or_twice_saved_one():
    from kvfill.record.assemble import merge_states

    full = _full(GDN, s=1)
    parts = [(r, 2, GDN, [st.take(t, r, 2) for st, t in zip(GDN, full)], f"TP rank {r}") for r in (1, 0)]
    merged, layout = merge_states("l", parts, "prompt k")
    assert layout == GDN and all(torch.equal(a, b) for a, b in zip(merged, full))
    with pytest.raises(RuntimeError, match=r"arrived from TP ranks \[1\] of \[2\].*each of 2 ranks once"):
        merge_states("l", parts[:1], "prompt k")
    with pytest.raises(RuntimeError, match=r"arrived from TP ranks \[0, 0\]"):
        merge_states("l", [parts[1], parts[1]], "prompt k")
    bad = [(0, 2, GDN, [t[..., :-1] if i == 0 else t for i, t in enumerate(parts[1][3])], "TP rank 0"), parts[0]]
    with pytest.raises(RuntimeError, match="from TP rank 0 holds"):
        merge_states("l", bad, "prompt k")


@pytest.mark.needs_vllm
def test_non_finite_recorded_states_are_counted_and_named_like_rows():
    """NaN or inf in a recorded state is replayed into every request whose
    sequence it is: counted at load and named in the start-up warning (issue 38)."""
    from kvfill.connector.bank_checks import count_nonfinite, nonfinite_warning

    bank = _bank()
    assert count_nonfinite(bank) == {}
    state = bank.states["model.layers.0.linear_attn"]
    state[1].view(-1)[:10] = float("nan")  # the recurrent state (float32)
    state[0].view(-1)[3] = float("inf")  # the conv state (bf16)
    counts = count_nonfinite(bank)
    assert counts == {"model.layers.0.linear_attn (state)": 11}
    assert "model.layers.0.linear_attn (state)" in nonfinite_warning("b.st", counts)
