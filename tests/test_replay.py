"""Replay: the planned slots hold the bank's recorded rows, every other byte is
unchanged - every layout, both backends, DCP, wrap past the recorded
positions (each sequence its own length: a ragged bank); the bank file
format; errors that write nothing."""
import pytest
import torch
from cases import CASE_IDS, CASES, NUM_BLOCKS
from oracle import poisoned_buffer, write_expected
from test_dcp import BS, HEADS, LAYOUTS, LOCAL, NUM_TOKENS, TABLE, C, caches, owner_and_local, rank_entries, slot_bytes
from test_fill_layouts import _row_size, assert_same_bytes

from kvfill.bank import RowFormat
from kvfill.kernels import Bank, BankError, BankIndex, CacheGroup, DcpGeometry, FillEngine, GroupFill
from kvfill.kernels import values as V

SEQS, POSITIONS = 3, 11  # entries below reach position 18: rows past 11 wrap
RAGGED = [5, 11, 8]  # a ragged bank: sequence s has RAGGED[s] rows, T = 24
# (block, slot_start, slot_end, local_base, sequence)
SLOT_ENTRIES = [(4, 3, 8, 0, 2), (1, 0, 8, 8, 0), (5, 0, 2, 16, 1)]
STATE_ENTRIES = [(4, 0, 1, 7, 1), (2, 0, 1, 9, 2)]
DTYPES = [
    ("fp32", torch.float32, "auto"),
    ("bf16", torch.bfloat16, "auto"),
    ("fp8e5m2", torch.float8_e5m2, "auto"),
    ("u8-fp8e4m3", torch.uint8, "fp8_e4m3"),
    ("u8-packed", torch.uint8, "packed"),
]


def random_bank(layers, case, dtype, seqs=SEQS, positions=POSITIONS, seed=5, lengths=None) -> Bank:
    """Random bits per layer, ``[S, N, layer row]`` in ``dtype`` (any bit
    pattern: replay moves bits, it never decodes them); ``lengths``: a
    ragged bank instead, ``[sum(lengths), layer row]``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    total = sum(lengths) if lengths is not None else seqs * positions
    for name, caches_ in layers.items():
        tensors = caches_ if isinstance(caches_, list) else [caches_]
        row = sum(_row_size(t, case.block_dim, case.slot_dim) for t in tensors)
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = torch.randint(0, 256, (total * row * itemsize,), dtype=torch.uint8, generator=g,
                            device="cpu")  # a host bank, as Bank.load gives: the engine uploads it
        out[name] = raw.view(dtype).view(seqs, positions, row) if lengths is None else raw.view(dtype).view(total, row)
    return Bank(out) if lengths is None else Bank(out, sequence_lengths=lengths)


def bank_row(bank, name, seq, pos):
    """Row ``pos mod N_seq`` of sequence ``seq`` of a layer: the replay rule,
    computed from the sequences' lengths alone (not ``bank.starts``)."""
    lengths = list(bank.lengths)
    return bank.layers[name][sum(lengths[:seq]) + pos % lengths[seq]]


def expected_replay(layers, case, dtype, encoding, entries, bank, dcp=(1, 0, 1)):
    """The oracle: row (sequence, position mod N_sequence) of each layer's
    bank rows, written with plain indexing into views over the expected buffer."""
    from oracle import dcp_position

    zero = V.value_dtype(dtype, encoding) is None
    for name, caches_ in layers.items():
        tensors = caches_ if isinstance(caches_, list) else [caches_]
        elem_offset = 0
        for t in tensors:
            row = _row_size(t, case.block_dim, case.slot_dim)
            for block, lo, hi, base, seq in entries:
                for s in range(lo, hi):
                    pos = dcp_position(base + s, *dcp)
                    bits = bank_row(bank, name, seq, pos).view(V.BITS_DTYPE[t.element_size()])
                    bits = torch.zeros(row, dtype=bits.dtype) if zero else bits[elem_offset:elem_offset + row]
                    write_expected(t, block_dim=case.block_dim, slot_dim=case.slot_dim,
                                   kernel_split=case.kernel_split, block=block, slot=s, bits=bits)
            elem_offset += row


def plan_of(entries):
    return {"g": GroupFill(*zip(*entries))}


def replay_engine(layers, case, encoding, backend, bank, **group_kw):
    group = CacheGroup(layers, num_blocks=NUM_BLOCKS, block_dim=case.block_dim, slot_dim=case.slot_dim,
                       encoding=encoding, **group_kw)
    return FillEngine({"g": group}, bank=bank, backend=backend)


def check_replay(case, dtype_case, backend, lengths=None, entries=None):
    _, dtype, encoding = dtype_case
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = poisoned_buffer(case.nbytes(itemsize))
    poison, expected = buf.clone(), buf.clone()
    layers = case.make(buf, dtype)
    bank = random_bank(layers, case, dtype, lengths=lengths)
    if entries is None:
        entries = STATE_ENTRIES if case.state_list else SLOT_ENTRIES

    engine = replay_engine(layers, case, encoding, backend, bank)
    stats = engine.fill(plan_of(entries))

    expected_replay(case.make(expected, dtype), case, dtype, encoding, entries, bank)
    assert_same_bytes(buf, expected)
    assert (buf != poison).any(), "the fill wrote nothing"
    assert stats.slots == sum(hi - lo for _, lo, hi, _, _ in entries) * sum(
        len(c) if isinstance(c, list) else 1 for c in layers.values())
    assert engine.verify(plan_of(entries)).ok
    return buf, poison, engine, entries


@pytest.mark.parametrize("dtype_case", DTYPES, ids=[d[0] for d in DTYPES])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_replay_writes_the_bank_rows_and_nothing_else(case, dtype_case, backend):
    check_replay(case, dtype_case, backend)


# (block, slot_start, slot_end, local_base, sequence) over RAGGED = [5, 11, 8]:
# positions 3..7 of sequence 0 (rows 3, 4, 0, 1, 2: wrapped at 5), 8..15 of
# sequence 1 (8, 9, 10, 0..4: wrapped at 11), 16..17 of sequence 2 (0, 1:
# wrapped at 8), 24..31 of sequence 2 (0..7) and 0..7 of sequence 1 (no wrap).
RAGGED_ENTRIES = [(4, 3, 8, 0, 0), (1, 0, 8, 8, 1), (5, 0, 2, 16, 2), (2, 0, 8, 24, 2), (0, 0, 8, 0, 1)]
RAGGED_STATE_ENTRIES = [(4, 0, 1, 7, 0), (2, 0, 1, 9, 1), (0, 0, 1, 12, 2)]  # state rows at 7 mod 5, 9, 12 mod 8
RAGGED_CASES = [c for c in CASES if c.name in ("vllm-LBNHC", "vllm-BHLNC", "std-LBNHC", "std-BHLNC", "fa-2xB",
                                                "hnd-Bx2", "mla", "mamba-states", "LBNHC-kernel-split2",
                                                "vllm-LBNHC-kernel-split2", "LBNHC-padded")]


@pytest.mark.parametrize("dtype_case", [DTYPES[1], DTYPES[3]], ids=["bf16", "u8-fp8e4m3"])
@pytest.mark.parametrize("case", RAGGED_CASES, ids=lambda c: c.name)
def test_ragged_replay_wraps_each_sequence_at_its_own_length(case, dtype_case, backend):
    """A bank of 3 sequences of 5, 11 and 8 rows: slot t of sequence s holds
    row t mod N_s of s (entries past every sequence's own length), every other
    byte is unchanged; verify agrees, and catches one corrupted element."""
    entries = RAGGED_STATE_ENTRIES if case.state_list else RAGGED_ENTRIES
    buf, poison, engine, entries = check_replay(case, dtype_case, backend, lengths=RAGGED, entries=entries)
    plan = plan_of(entries)
    written = (buf != poison).nonzero().flatten()
    assert written.numel() > 0
    at = int(written[written.numel() // 2])
    buf[at] ^= 0xFF  # one byte of one written element
    report = engine.verify(plan)
    assert not report.ok and report.num_mismatched == 1, report
    buf[at] ^= 0xFF
    assert engine.verify(plan).ok


def test_the_ragged_oracle_reads_the_rows_it_names():
    """The test's own arithmetic against the bank: sequence s's rows start at
    the sum of the earlier lengths; the table the kernel reads says the same."""
    rows = torch.arange(sum(RAGGED) * 2, dtype=torch.int32).view(-1, 2)
    bank = Bank({"l": rows}, sequence_lengths=RAGGED)
    assert bank.starts == (0, 5, 16) and bank.num_positions == 11 and bank.num_rows == 24
    assert bank.sequence_table().tolist() == [[0, 5], [5, 11], [16, 8]]
    assert bank_row(bank, "l", 0, 7).tolist() == [4, 5]      # row 2 of sequence 0
    assert bank_row(bank, "l", 1, 11).tolist() == [10, 11]   # row 0 of sequence 1 (start 5)
    assert bank_row(bank, "l", 2, 17).tolist() == [34, 35]   # row 1 of sequence 2 (start 16)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("vllm-LBNHC", "vllm-HLBNC", "mla")],
                         ids=lambda c: c.name)
def test_torch_replay_per_entry_and_whole_page_paths_write_the_same(case, monkeypatch):
    """Large entries take the per-entry copy or the one-pass page gather: force both."""
    from kvfill.kernels import torch_fill, torch_pages

    monkeypatch.setattr(torch_fill, "PER_ENTRY_BYTES", 0)
    monkeypatch.setattr(torch_pages, "PAGE_BYTES", 0)  # tiny test pages take the page paths too
    check_replay(case, DTYPES[1], "torch")


def test_replay_of_whole_pages_in_one_pass_on_the_vllm_cpu_layout(monkeypatch):
    """vLLM CPU's (2, B, H, N, D): consecutive whole blocks are gathered from
    the bank straight into the cache, one index_select per run (torch_pages.fill_pages_direct)."""
    from kvfill.kernels import torch_fill, torch_pages

    B, H, N, D = 6, 2, 4, 8
    buf = poisoned_buffer(2 * (2 * B * H * N * D) * 2)
    poison = buf.clone()
    caches_ = buf.view(torch.bfloat16).view(2, 2, B, H, N, D)
    layers = {"a": caches_[0], "b": caches_[1]}
    bank = Bank({n: torch.randn(11, 2 * H * D).to(torch.bfloat16) for n in layers}, sequence_lengths=[7, 4])
    calls = []
    real = torch_pages.fill_pages_direct
    monkeypatch.setattr(torch_fill, "PER_ENTRY_BYTES", 0)
    monkeypatch.setattr(torch_pages, "PAGE_BYTES", 0)  # tiny test pages take the page paths too
    monkeypatch.setattr(torch_pages, "fill_pages_direct", lambda *a: calls.append(1) or real(*a))
    eng = FillEngine({"g": CacheGroup(layers, block_dim=1, slot_dim=3)}, bank=bank, backend="torch")
    blocks, seq = [2, 3, 4, 0], [1, 1, 0, 1]
    eng.fill({"g": GroupFill(blocks, local_base=[0, 4, 8, 12], sequence=seq)})
    assert calls, "the one-pass page path did not run"
    for name, t in layers.items():
        for k, (b, s) in enumerate(zip(blocks, seq)):
            for slot in range(N):
                # sequence 0: 7 rows from row 0; sequence 1: 4 rows from row 7
                row = (4 * k + slot) % 7 if s == 0 else 7 + (4 * k + slot) % 4
                assert torch.equal(t[:, b, :, slot].reshape(-1), bank.layers[name][row]), (name, b, slot)
    bits = buf.view(torch.int16).view(2, 2, B, H, N, D)  # bits: poison holds NaNs
    assert torch.equal(bits[:, :, [1, 5]], poison.view(torch.int16).view(2, 2, B, H, N, D)[:, :, [1, 5]])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("interleave", [1, 4])
def test_replay_ranks_reassembled_equal_single_rank_replay(world, interleave, backend, layout):
    """Each rank replays the rows of its tokens' global positions: token t <
    N_s on rank (t // I) % W equals token t of the W = 1 replay; past N_s each
    rank wraps within the rows it holds (``bank/parts.py``): local slot l reads
    its local row l mod L_r, L_r = how many of the N_s positions it holds."""
    g = torch.Generator(device="cpu").manual_seed(3)
    bank = Bank({f"layer.{i}": torch.randn(40 + 33, HEADS * C, generator=g, device="cpu").to(torch.float16)
                 for i in range(2)}, sequence_lengths=[40, 33])  # ragged: sequence 1 wraps at 33

    def run(w, rank, seed):
        _, layers = caches(seed, layout)
        eng = FillEngine({"full": CacheGroup(layers, block_dim=LAYOUTS[layout][1], slot_dim=2,
                                             dcp=DcpGeometry(w, rank, interleave))}, bank=bank, backend=backend)
        entries = rank_entries(w, rank, interleave)
        if entries:
            b, lo, hi, base = zip(*entries)
            eng.fill({"full": GroupFill(b, lo, hi, base, [1] * len(b))})
        return layers

    ref = run(1, 0, 100)
    ranks = [run(world, r, 200 + r) for r in range(world)]
    for t in range(LOCAL, NUM_TOKENS - 1):
        r, loc = owner_and_local(t, world, interleave)
        got = slot_bytes(ranks[r], TABLE[loc // BS], loc % BS, layout)
        want = slot_bytes(ref, TABLE[t // BS], t % BS, layout)
        if t < 33:
            assert torch.equal(got, want), f"token {t} on rank {r} (local {loc})"
        # the W = 1 replay holds sequence 1's row at position t mod 33 (its rows start at 40)
        assert torch.equal(want[0].reshape(-1).cpu(), bank.layers["layer.0"][40 + t % 33].view(torch.uint8).cpu()), \
            f"token {t}"
        # rank r: its local row loc mod L_r, the row of the position it holds there
        dcp = DcpGeometry(world, r, interleave)
        held = int(dcp.global_positions(loc % int(dcp.local_count(33))))
        row = bank.layers["layer.0"][40 + held].view(torch.uint8).cpu()  # compared on the host
        assert torch.equal(got[0].reshape(-1).cpu(), row), \
            f"token {t} on rank {r} (local {loc})"


def test_verify_compares_replayed_slots_with_the_bank(backend):
    cache = torch.zeros(4, 2, 8, 16, dtype=torch.bfloat16)  # [B, H, N, C]
    bank = Bank({"l": torch.randn(2, 9, 32).to(torch.bfloat16)})
    eng = FillEngine({"g": CacheGroup({"l": cache})}, bank=bank, backend=backend)
    plan = {"g": GroupFill([1, 3], [0, 2], [8, 5], [0, 8], [1, 0])}
    eng.fill(plan)
    assert eng.verify(plan).ok
    cache[3, 1, 4, 7] += 1  # block 3 slot 4: position 12, sequence 0
    report = eng.verify(plan)
    assert not report.ok and report.num_mismatched == 1
    m = report.first[0]
    assert (m.block, m.slot, m.element) == (3, 4, 16 + 7)
    assert m.expected == float(bank.layers["l"][12 % 9, 23])  # sequence 0: rows 0..8


def _one_layer(dtype=torch.bfloat16):
    buf = poisoned_buffer(4 * 2 * 8 * 16 * 2)
    return buf, {"l": buf.view(dtype).view(4, 2, 8, 16)}


@pytest.mark.parametrize("bad, match", [
    ({"x": torch.zeros(1, 4, 32, dtype=torch.bfloat16)}, r"no rows for layer 'l'"),
    ({"l": torch.zeros(1, 4, 32, dtype=torch.float16)}, r"recorded as torch.float16, the cache holds torch.bfloat16"),
    ({"l": torch.zeros(1, 4, 16, dtype=torch.bfloat16)}, r"rows have 16 elements, the cache's have 32"),
])
def test_a_bank_that_does_not_match_the_caches_is_refused(bad, match):
    buf, layers = _one_layer()
    poison = buf.clone()
    with pytest.raises(BankError, match=match):
        FillEngine({"g": CacheGroup(layers)}, bank=Bank(bad))
    assert torch.equal(buf, poison)


def test_a_sequence_outside_the_bank_is_refused_before_any_write(backend):
    buf, layers = _one_layer()
    eng = FillEngine({"g": CacheGroup(layers)}, bank=Bank({"l": torch.zeros(2, 4, 32, dtype=torch.bfloat16)}),
                     backend=backend)
    poison = buf.clone()
    with pytest.raises(ValueError, match=r"entry 1 \(block 2\): sequence 2 is out of range; expected 0 <= sequence < 2"):
        eng.fill({"g": GroupFill([1, 2], sequence=[1, 2])})
    assert torch.equal(buf, poison)
    no_bank = FillEngine({"g": CacheGroup(layers)}, backend=backend)
    with pytest.raises(ValueError, match=r"sequence 1 is out of range; expected 0 <= sequence < 1"):
        no_bank.fill({"g": GroupFill([1], sequence=[1])})
    assert torch.equal(buf, poison)


def test_a_bank_larger_than_free_device_memory_is_refused(monkeypatch):
    from kvfill.kernels import bank_placement

    buf, layers = _one_layer()
    # rows on another device than the caches are uploaded (a host bank for GPU
    # caches): here rows on the meta device, and 100 bytes free
    bank = Bank({"l": torch.zeros(2, 4, 32, dtype=torch.bfloat16, device="meta")})
    monkeypatch.setattr(bank_placement, "free_bytes", lambda device: 100)
    poison = buf.clone()
    with pytest.raises(BankError, match=r"rows need 512 B on \w+(:\d)?, 100 B are free"):
        FillEngine({"g": CacheGroup(layers)}, bank=bank)
    assert torch.equal(buf, poison)


def test_mode_replay_without_a_bank_is_refused():
    _, layers = _one_layer()
    with pytest.raises(ValueError, match="mode 'replay' needs a bank"):
        FillEngine({"g": CacheGroup(layers, mode="replay")})


def test_zero_mode_groups_are_not_replayed_and_need_no_bank_rows():
    """Recurrent state (a group registered ``zero``) gets zeros under replay."""
    _, layers = _one_layer()
    state = torch.full((4, 64), 7, dtype=torch.bfloat16)
    eng = FillEngine({"g": CacheGroup(layers), "m": CacheGroup({"s": [state]}, mode="zero")},
                     bank=Bank({"l": torch.ones(1, 4, 32, dtype=torch.bfloat16)}), backend="torch")
    eng.fill({"m": GroupFill([2], [0], [1], [5])})
    assert (state[2] == 0).all() and (state[[0, 1, 3]] == 7).all()


def test_bank_file_round_trip_keeps_rows_metadata_and_sequence_choice(tmp_path):
    pytest.importorskip("safetensors")  # a torch + triton only image (the GPU check) may lack it
    rows = {"a": torch.randn(2, 5, 8, device="cpu").to(torch.bfloat16),
            "b": torch.randint(0, 255, (2, 5, 4), dtype=torch.uint8, device="cpu")}
    prompts = [list(range(10, 20)), list(range(30, 37))]
    bank = Bank(rows, sequence_tokens=[p[:5] for p in prompts], value_dtypes={"a": "bfloat16", "b": "float8_e4m3fn"},
                metadata={"model": "m", "vllm_version": "0.32.0"})
    path = tmp_path / "bank.safetensors"
    bank.save(path)
    back = Bank.load(path)
    assert all(torch.equal(back.layers[n], rows[n].reshape(10, -1)) for n in rows)  # [S, N, R] saved as [S * N, R]
    assert back.metadata == {"model": "m", "vllm_version": "0.32.0"}
    assert back.bytes_per_token == 8 * 2 + 4 and back.nbytes == 2 * 5 * 20
    index = BankIndex.read(path)
    assert (index.num_sequences, index.num_positions) == (2, 5)
    # a recorded prompt replays its own sequence; others a fixed hash of the prompt
    assert [index.sequence_for(p) for p in prompts] == [0, 1]
    other = list(range(100, 140))
    assert index.sequence_for(other) == index.sequence_for(list(other)) in (0, 1)
    picks = {index.sequence_for(list(range(i, i + 30))) for i in range(200, 240)}
    assert picks == {0, 1}, "unrecorded prompts spread over the sequences"
    assert back.lengths == (5, 5) and back.value_dtypes == {"a": "bfloat16", "b": "float8_e4m3fn"}
    with pytest.raises(BankError, match="holds float8_e4m3fn values, the cache encodes float8_e5m2"):
        back.rows_for("b", torch.uint8, RowFormat.of([[4]]), torch.float8_e5m2)
    assert torch.equal(back.rows_for("b", torch.uint8, RowFormat.of([[4]]), torch.float8_e4m3fn), rows["b"].view(10, 4))


def test_ragged_bank_file_round_trip_keeps_each_sequences_rows_and_tokens(tmp_path):
    pytest.importorskip("safetensors")
    g = torch.Generator(device="cpu").manual_seed(4)
    rows = torch.randn(sum(RAGGED), 6, generator=g, device="cpu").to(torch.float16)
    tokens = [list(range(100 + 20 * s, 100 + 20 * s + n)) for s, n in enumerate(RAGGED)]
    Bank({"l": rows}, sequence_lengths=RAGGED, sequence_tokens=tokens).save(tmp_path / "r.safetensors")
    back = Bank.load(tmp_path / "r.safetensors")
    assert back.lengths == tuple(RAGGED) and [list(t) for t in back.sequence_tokens] == tokens
    assert torch.equal(back.layers["l"], rows) and back.num_positions == 11
    index = BankIndex.read(tmp_path / "r.safetensors")
    assert [index.sequence_for(t) for t in tokens] == [0, 1, 2]
    assert "3 sequences of 5-11 positions (24 rows)" in back.describe()


def test_a_file_that_is_not_a_bank_is_refused_with_its_name(tmp_path):
    pytest.importorskip("safetensors")  # a torch + triton only image (the GPU check) may lack it
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(BankError, match=r"w.safetensors: not a kvfill bank"):
        Bank.load(path)
    with pytest.raises(BankError, match=r"does not exist; record one with `python -m kvfill.record`"):
        BankIndex.read(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("mode", ["normal", "replay"])
def test_whole_pages_of_vllm_cpus_k_and_v_views_staged_equal_the_triton_bytes(monkeypatch, mode):
    """vLLM CPU's real layout (K transposed, V after it in each (block, head)
    page; connector/cpu_layout.py): whole pages go through the staging buffer
    (torch_pages.fill_pages_staged), runs of consecutive blocks and single
    blocks; the bytes equal the Triton kernel's (itself checked against the
    oracle above) and nothing else changes."""
    from kvfill.connector.cpu_layout import cpu_kv_parts
    from kvfill.kernels import torch_fill, torch_pages

    nb, heads, slots, dim = 7, 2, 8, 4
    bank = Bank({f"l{i}": torch.randn(2, 30, 2 * heads * dim).to(torch.bfloat16) for i in range(2)})
    plan = {"g": GroupFill([2, 3, 4, 0, 6], local_base=[0, 8, 16, 24, 32],
                           sequence=[1, 1, 0, 1, 0] if mode == "replay" else None)}
    out = {}
    calls = []
    real = torch_pages.fill_pages_staged
    monkeypatch.setattr(torch_fill, "PER_ENTRY_BYTES", 0)
    monkeypatch.setattr(torch_pages, "PAGE_BYTES", 0)  # tiny test pages take the page paths too
    monkeypatch.setattr(torch_pages, "CHUNK_BYTES", 2 * slots * 2 * heads * dim * 2)  # two pages per chunk
    monkeypatch.setattr(torch_pages, "fill_pages_staged", lambda *a: calls.append(1) or real(*a))
    for backend in ("torch", "triton"):
        buf = poisoned_buffer(2 * nb * heads * slots * 2 * dim * 2, seed=8)
        caches_ = buf.view(torch.bfloat16).view(2, nb, heads, slots, 2 * dim)
        layers = {f"l{i}": cpu_kv_parts(caches_[i], dim) for i in range(2)}
        eng = FillEngine({"g": CacheGroup(layers, slot_dim=2)}, std=0.5, seed=3, backend=backend,
                         bank=bank if mode == "replay" else None)
        eng.fill(plan)
        assert eng.verify(plan).ok
        out[backend] = buf
    assert calls, "the staged page path did not run"
    assert_same_bytes(out["torch"], out["triton"])
    untouched = poisoned_buffer(out["torch"].numel(), seed=8).view(2, nb, -1)[:, [1, 5]]
    assert torch.equal(out["torch"].view(2, nb, -1)[:, [1, 5]], untouched)


def test_a_bank_from_caches_with_another_element_order_is_refused(tmp_path):
    pytest.importorskip("safetensors")  # a torch + triton only image (the GPU check) may lack it
    """Rows recorded from K/V views ([8, 4] + [8, 4]) are not replayed into a
    [B, H, N, 2D] cache ([8, 8]): the same row size, another element order."""
    from kvfill.connector.cpu_layout import cpu_kv_parts

    cache = torch.zeros(3, 8, 16, 8, dtype=torch.bfloat16)
    split = FillEngine({"g": CacheGroup({"l": cpu_kv_parts(cache, 4)}, slot_dim=2)})
    fmt = split.row_formats()["l"]
    assert [list(p) for p in fmt.parts] == [[8, 4], [8, 4]] and fmt.kv == (8, 4, 4)
    # a native bank (no kv: rows in the cache's own element order, named by its parts)
    bank = Bank({"l": torch.zeros(1, 4, 64, dtype=torch.bfloat16)}, parts={"l": [[8, 4], [8, 4]]})
    bank.save(tmp_path / "b.safetensors")
    bank = Bank.load(tmp_path / "b.safetensors")
    FillEngine({"g": CacheGroup({"l": cpu_kv_parts(torch.zeros_like(cache), 4)}, slot_dim=2)}, bank=bank)
    with pytest.raises(BankError, match=r"recorded in the element order of caches with element dims "
                                        r"\[\[8, 4\], \[8, 4\]\] \(no known K/V view\), these caches have "
                                        r"\[\[8, 8\]\]"):
        FillEngine({"g": CacheGroup({"l": torch.zeros_like(cache)})}, bank=bank)
    # ... even where the cache's geometry is given: a native bank has no K/V order to permute
    with pytest.raises(BankError, match=r"element dims"):
        FillEngine({"g": CacheGroup({"l": torch.zeros_like(cache)}, kv=(8, 4, 4))}, bank=bank)


def test_parts_name_the_logical_view_not_the_strides():
    """Two physical orders of one logical view record the same parts; two
    views with equal merged shapes but other element orders do not
    ([B, H, N, 2D] vs (2, B, N, H, D) with H = 2: both merge to [2, 256])."""
    std = torch.zeros(4, 2, 16, 256, dtype=torch.bfloat16)                      # [B, H, N, 2D]
    flash = torch.zeros(2, 4, 16, 2, 128, dtype=torch.bfloat16)                 # (2, B, N, H, D)
    hnd = torch.zeros(4, 16, 2, 256, dtype=torch.bfloat16).permute(0, 2, 1, 3)  # [B, H, N, 2D], N outer
    formats = {name: FillEngine({"g": CacheGroup({"l": t}, block_dim=bd, slot_dim=sd)}).row_formats()["l"]
               for name, t, bd, sd in (("std", std, 0, 2), ("flash", flash, 1, 2), ("hnd", hnd, 0, 2))}
    parts = {name: [list(p) for p in f.parts] for name, f in formats.items()}
    assert parts == {"std": [[2, 256]], "flash": [[2, 2, 128]], "hnd": [[2, 256]]}
    # only the flash view names its K/V geometry by itself ([H, 2D] could be one head of 2D)
    assert {name: f.kv for name, f in formats.items()} == {"std": None, "flash": (2, 128, 128), "hnd": None}
    bank = Bank({"l": torch.zeros(1, 4, 512, dtype=torch.bfloat16)}, parts={"l": parts["flash"]})
    with pytest.raises(BankError, match="element dims"):
        FillEngine({"g": CacheGroup({"l": std})}, bank=bank)
    FillEngine({"g": CacheGroup({"l": flash}, block_dim=1, slot_dim=2)}, bank=bank)


def test_device_built_replay_entries_stay_inside_the_bank():
    """fill_device_entries is not validated on the host: a sequence past the
    bank is clamped to the last one, a negative base wraps like t mod N_s
    (the last sequence's own length in a ragged bank)."""
    cache = torch.zeros(4, 2, 8, 16, dtype=torch.bfloat16)  # [B, H, N, C]: row 32
    bank = Bank({"l": torch.randn(9 + 5 + 7, 32, device="cpu").to(torch.bfloat16)}, sequence_lengths=[9, 5, 7])
    eng = FillEngine({"g": CacheGroup({"l": cache})}, bank=bank, backend="triton")
    entries = torch.tensor([[1, 0, 4, -3, 7], [2, 0, 2, 0, 1]], dtype=torch.int32)
    assert eng.fill_device_entries("g", entries) == 1
    rows = bank.layers["l"]
    for slot, pos in enumerate([4, 5, 6, 0]):  # positions -3..0 -> rows 4, 5, 6, 0 of sequence 2 (clamped; 7 rows)
        assert torch.equal(cache[1, :, slot].reshape(-1).cpu(), rows[14 + pos].cpu()), slot
    for slot in range(2):
        assert torch.equal(cache[2, :, slot].reshape(-1).cpu(), rows[9 + slot].cpu())  # sequence 1 starts at row 9
    assert (cache[1, :, 4:] == 0).all() and (cache[[0, 3]] == 0).all()


def test_every_groups_replay_entries_launch_with_warmups_specialisation(monkeypatch):
    """Triton specialises the entries pointer on its 16-byte alignment; each
    group's entries are a slice of one upload of 20-byte rows, so a slice
    starting off a 16-byte boundary would compile a variant warmup never
    launched - at the first replaying step of a hybrid model, or under
    capture.  The key is Triton's own (``get_tensor_specialization``)."""
    from triton.backends.compiler import BaseBackend

    from kvfill.kernels import triton_fill

    key_of = getattr(BaseBackend, "get_tensor_specialization",  # Triton's; its rule where a version lacks it
                     lambda t, align: "D" if align and t.data_ptr() % 16 == 0 else "")
    keys = []
    real = triton_fill.launch_fill

    def spy(entries, *args, **kwargs):
        keys.append((entries.shape[1], key_of(entries, align=True)))
        return real(entries, *args, **kwargs)

    monkeypatch.setattr(triton_fill, "launch_fill", spy)
    bufs = [poisoned_buffer(NUM_BLOCKS * 2 * 8 * 8 * 2, seed=s) for s in (1, 2, 3)]
    layers = {f"l{i}": b.view(torch.bfloat16).view(NUM_BLOCKS, 2, 8, 8) for i, b in enumerate(bufs)}
    g = torch.Generator(device="cpu").manual_seed(2)
    bank = Bank({n: torch.randn(2, 24, 2 * 8, generator=g, device="cpu").to(torch.bfloat16) for n in layers})
    groups = {n: CacheGroup({n: t}) for n, t in layers.items()}
    eng = FillEngine(groups, bank=bank, backend="triton")
    eng.warmup()
    warm = set(keys)
    keys.clear()
    # 1, 2 and 3 entries: without padding the 2nd and 3rd groups' slices start 20 and 60 bytes in.
    plan = {"l0": GroupFill([1], local_base=[0], sequence=[1]),
            "l1": GroupFill([2, 3], local_base=[0, 8], sequence=[0, 1]),
            "l2": GroupFill([4, 0, 5], local_base=[0, 8, 16], sequence=[1, 0, 1])}
    eng.fill(plan)
    assert len(keys) == 3 and set(keys) <= warm, f"fill launched {keys}, warmup compiled {warm}"
    assert eng.verify(plan).ok
