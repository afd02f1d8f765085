"""A bank kept in host memory (``bank_placement="host"``, kernels/staging.py):
each fill's rows staged on the device write the bytes a device-resident bank
writes - every layout, both backends, wrap past each sequence's length, DCP
ranks, several groups, rows permuted to a cache's own order, fills larger
than the staging (chunks) - in poisoned memory, nothing else changed; and
what it refuses.  Under the accelerator stand-in (tests/device_rule.py) the
bank stays a host tensor and the caches and staging are on the stand-in
device, so a host/device mix-up fails as on a GPU."""
import numpy as np
import pytest
import torch
from cases import CASES, NUM_BLOCKS
from oracle import poisoned_buffer
from test_dcp import BS, HEADS, LAYOUTS, C, caches, rank_entries
from test_fill_layouts import assert_same_bytes
from test_replay import (
    RAGGED, RAGGED_ENTRIES, RAGGED_STATE_ENTRIES, expected_replay, plan_of, random_bank,
)

from kvfill.kernels import Bank, BankError, CacheGroup, DcpGeometry, FillEngine, GroupFill
from kvfill.kernels import bank_placement, staging, triton_fill
from kvfill.kernels import values as V

DTYPES = [("bf16", torch.bfloat16, "auto"), ("u8-fp8e4m3", torch.uint8, "fp8_e4m3")]


def replayed(case, dtype, encoding, backend, bank, entries, **placement):
    """A fresh poisoned buffer replayed with ``entries``: (buffer, the untouched poison, engine)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = poisoned_buffer(case.nbytes(itemsize))
    poison = buf.clone()
    group = CacheGroup(case.make(buf, dtype), num_blocks=NUM_BLOCKS, block_dim=case.block_dim,
                       slot_dim=case.slot_dim, encoding=encoding)
    engine = FillEngine({"g": group}, bank=bank, backend=backend, **placement)
    engine.fill(plan_of(entries))
    return buf, poison, engine


# Every layout in bf16, every third in fp8 bytes too (tests/test_replay.py holds every dtype of plain replay).
LAYOUT_DTYPES = [(c, d) for i, c in enumerate(CASES) for d in DTYPES if d is DTYPES[0] or i % 3 == 0]


@pytest.mark.parametrize("case,dtype_case", LAYOUT_DTYPES, ids=[f"{c.name}-{d[0]}" for c, d in LAYOUT_DTYPES])
def test_a_host_bank_writes_the_device_banks_bytes_and_nothing_else(case, dtype_case, backend, staging="one block"):
    """A ragged bank (3 sequences of 5, 11 and 8 rows; entries past each
    length wrap): the host-kept bank's fill equals the device-resident
    bank's byte for byte, and the oracle's; staged one block per chunk (or
    all at once: the next test); verify reads the host rows and agrees."""
    _, dtype, encoding = dtype_case
    entries = RAGGED_STATE_ENTRIES if case.state_list else RAGGED_ENTRIES
    layers = case.make(poisoned_buffer(case.nbytes(torch.empty((), dtype=dtype).element_size())), dtype)
    bank = random_bank(layers, case, dtype, lengths=RAGGED)
    dev, poison, _ = replayed(case, dtype, encoding, backend, bank, entries)
    host, _, engine = replayed(case, dtype, encoding, backend, bank, entries, bank_placement="host",
                               staging_bytes=1 if staging == "one block" else None)
    assert_same_bytes(host, dev)
    expected = poison.clone()
    expected_replay(case.make(expected, dtype), case, dtype, encoding, entries, bank)
    assert_same_bytes(host, expected)
    assert engine.verify(plan_of(entries)).ok
    assert "bank in host memory" in engine.describe()
    # staging_bytes 1 is raised to one block's rows, and the engine says so (issue 61's ninth finding)
    assert ("staging_bytes 1 B is less than one block's rows: raised to one block" in engine.describe()) == \
        (staging == "one block"), engine.describe()


def _lbnhc():
    """The [L, B, N, H, C] case: vLLM's views where vLLM is installed, the standard ones in the device image."""
    return next(c for c in CASES if c.name in ("vllm-LBNHC", "std-LBNHC"))


@pytest.mark.parametrize("name", ["LBNHC", "fa-2xB", "mla"])
def test_a_fill_staged_at_once_writes_the_device_banks_bytes(name, backend):
    case = _lbnhc() if name == "LBNHC" else next(c for c in CASES if c.name == name)
    test_a_host_bank_writes_the_device_banks_bytes_and_nothing_else(case, DTYPES[0], backend, staging="whole")


def test_verify_of_a_host_bank_catches_one_corrupted_byte(backend):
    case = _lbnhc()
    layers = case.make(poisoned_buffer(case.nbytes(2)), torch.bfloat16)
    bank = random_bank(layers, case, torch.bfloat16, lengths=RAGGED)
    buf, poison, engine = replayed(case, torch.bfloat16, "auto", backend, bank, RAGGED_ENTRIES,
                                   bank_placement="host", staging_bytes=1)
    written = (buf != poison).nonzero().flatten()
    at = int(written[written.numel() // 2])
    buf[at] ^= 0xFF
    report = engine.verify(plan_of(RAGGED_ENTRIES))
    assert not report.ok and report.num_mismatched == 1, report


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("world,interleave", [(2, 1), (2, 4), (4, 2)])
def test_each_dcp_rank_of_a_host_bank_writes_the_device_banks_bytes(world, interleave, layout, backend):
    """Each rank's fill from its part of a host-kept bank (its positions in
    local order, wrapping within them) equals the device-resident bank's."""
    g = torch.Generator(device="cpu").manual_seed(3)
    bank = Bank({f"layer.{i}": torch.randn(40 + 33, HEADS * C, generator=g, device="cpu").to(torch.float16)
                 for i in range(2)}, sequence_lengths=[40, 33])

    def run(rank, **placement):
        buf, layers = caches(50 + rank, layout)
        eng = FillEngine({"full": CacheGroup(layers, block_dim=LAYOUTS[layout][1], slot_dim=2,
                                             dcp=DcpGeometry(world, rank, interleave))},
                         bank=bank, backend=backend, **placement)
        entries = rank_entries(world, rank, interleave)
        b, lo, hi, base = zip(*entries)
        plan = {"full": GroupFill(b, lo, hi, base, [1] * len(b))}
        eng.fill(plan)
        assert eng.verify(plan).ok
        return buf

    for rank in range(world):
        assert_same_bytes(run(rank, bank_placement="host", staging_bytes=1), run(rank))


def _two_groups(seed, block_sizes=(8, 4)):
    """Two replayed groups of other block sizes (full attention, a sliding
    window's) and a zero-filled one, over one poisoned buffer."""
    n = [NUM_BLOCKS * HEADS * bs * C for bs in block_sizes]
    buf = poisoned_buffer(2 * (3 * n[0] + n[1]), seed)
    flat = buf.view(torch.bfloat16)
    full = {f"full.{i}": flat[i * n[0]:(i + 1) * n[0]].view(NUM_BLOCKS, HEADS, block_sizes[0], C)
            for i in range(2)}
    swa = {"swa.0": flat[2 * n[0]:2 * n[0] + n[1]].view(NUM_BLOCKS, HEADS, block_sizes[1], C)}
    zero = {"zero.0": flat[2 * n[0] + n[1]:].view(NUM_BLOCKS, HEADS, block_sizes[0], C)}
    return buf, {"full": CacheGroup(full), "swa": CacheGroup(swa), "zero": CacheGroup(zero, mode="zero")}


def test_several_groups_of_other_block_sizes_are_staged_each_in_its_own_chunks(backend):
    """A plan over two replayed groups of other block sizes and a zero group:
    each replayed group staged in chunks of its own (one group runs out of
    chunks before the other), the zero group written once; the bytes equal
    the device-resident bank's and the stage copies one per group and chunk."""
    g = torch.Generator(device="cpu").manual_seed(9)
    bank = Bank({n: torch.randn(30 + 21, HEADS * C, generator=g, device="cpu").to(torch.bfloat16)
                 for n in ("full.0", "full.1", "swa.0")}, sequence_lengths=[30, 21])
    plan = {"full": GroupFill([1, 4, 5, 3, 2], [0, 0, 3, 0, 0], [8, 8, 8, 8, 5], [0, 8, 16, 24, 40],
                              [0, 0, 1, 1, 0]),
            "swa": GroupFill([3, 0], [1, 0], [4, 4], [12, 16], [1, 1]),
            "zero": GroupFill([2], [0], [3], [0], [0])}
    out = []
    for placement in ({}, {"bank_placement": "host", "staging_bytes": 1}):
        buf, groups = _two_groups(31)
        eng = FillEngine(groups, bank=bank, backend=backend, **placement)
        stats = eng.fill(plan)
        assert eng.verify(plan).ok
        out.append((buf, stats))
    assert_same_bytes(out[1][0], out[0][0])
    assert out[1][1].slots == out[0][1].slots and out[1][1].bytes == out[0][1].bytes


def test_staged_chunks_keep_each_chunk_within_the_staging_and_name_staged_sequences():
    """The stage's own arithmetic on the host: chunks of at most the
    staging's rows per group, the entries unchanged but their sequence, and
    each staged sequence (first, length) reading the rows it staged."""
    bank = Bank({"l": torch.arange(24 * 4, dtype=torch.float32, device="cpu").view(24, 4)},
                sequence_lengths=RAGGED)
    rows = staging.host_rows(bank.layers["l"], None)
    staged = staging.Staging({"l": ("g", rows)}, bank.sequence_table(), torch.device("cpu"), capacity=8,
                             dcp={"g": DcpGeometry(1, 0, 1)})
    assert staged.capacity == 8
    entries = GroupFill(*map(np.asarray, zip(*RAGGED_ENTRIES))).normalized(8)
    sizes = []
    for chunk, table in staged.chunks({"g": entries}):  # each chunk's rows are staged as it is yielded
        e = chunk["g"]
        sizes.append(int((e.slot_end - e.slot_start).sum()))
        assert len(table) % 16 == 0 and (table[len(e.block_ids):, 1] == staging.STAGED_LENGTH).all()
        rows_now = staged.staging()["l"].view(torch.float32)
        for i in range(len(e.block_ids)):
            k = next(j for j, x in enumerate(RAGGED_ENTRIES) if x[0] == e.block_ids[i])
            seq = RAGGED_ENTRIES[k][4]
            first, length = table[e.sequence[i]]
            for slot in range(int(e.slot_start[i]), int(e.slot_end[i])):
                local = int(e.local_base[i]) + slot
                want = bank.starts[seq] + local % RAGGED[seq]
                assert torch.equal(rows_now[first + local % length].cpu(), bank.layers["l"][want]), (i, slot)
    assert sizes == [5, 8, 2, 8, 8]


def test_staged_fills_launch_with_one_specialisation_of_the_sequence_count(monkeypatch):
    """Triton specialises an int on being 1 and on its divisibility by 16:
    every staged launch, warmup's included, names a multiple of 16 staged
    sequences, so no fill compiles another variant."""
    counts = []
    real = triton_fill.launch_fill

    def spy(entries, layer_table, ref, layer_align, table, layout, mode, dcp, bank_row, bank_align, sequences,
            *rest):
        if mode == V.REPLAY:
            counts.append(sequences.shape[0])
        return real(entries, layer_table, ref, layer_align, table, layout, mode, dcp, bank_row, bank_align,
                    sequences, *rest)

    monkeypatch.setattr(triton_fill, "launch_fill", spy)
    case = _lbnhc()
    layers = case.make(poisoned_buffer(case.nbytes(2)), torch.bfloat16)
    bank = random_bank(layers, case, torch.bfloat16, lengths=RAGGED)
    _, _, engine = replayed(case, torch.bfloat16, "auto", "triton", bank, RAGGED_ENTRIES, bank_placement="host",
                            staging_bytes=1)
    engine.warmup()
    assert len(counts) > 3 and all(n % 16 == 0 for n in counts), counts


def test_a_host_banks_group_refuses_device_built_entries():
    case = _lbnhc()
    layers = case.make(poisoned_buffer(case.nbytes(2)), torch.bfloat16)
    bank = random_bank(layers, case, torch.bfloat16, lengths=RAGGED)
    buf = poisoned_buffer(case.nbytes(2))
    engine = FillEngine({"g": CacheGroup(case.make(buf, torch.bfloat16), num_blocks=NUM_BLOCKS,
                                         block_dim=case.block_dim, slot_dim=case.slot_dim)},
                        bank=bank, backend="triton", bank_placement="host")
    before = buf.clone()
    entries = torch.tensor([[1, 0, 4, 0, 0]], dtype=torch.int32, device=buf.device)
    with pytest.raises(ValueError, match="bank_placement 'host'.*need bank_placement 'device'"):
        engine.fill_device_entries("g", entries)
    assert torch.equal(buf, before)


def test_the_torch_backend_keeps_no_page_images_of_a_host_banks_rows(monkeypatch):
    """Page images of a replayed class hold bank rows on the device: a
    device-resident bank's engine keeps them, a host-kept one's does not."""
    from kvfill.connector.cpu_layout import cpu_kv_parts
    from kvfill.kernels import torch_pages

    monkeypatch.setattr(torch_pages, "PAGE_BYTES", 0)  # tiny test pages take the page paths too
    bank = Bank({"l0": torch.randn(2, 30, 16, device="cpu").to(torch.bfloat16)})
    held = {}
    for placement in ({}, {"bank_placement": "host"}):
        caches_ = poisoned_buffer(7 * 2 * 8 * 8 * 2).view(torch.bfloat16).view(7, 2, 8, 8)
        eng = FillEngine({"g": CacheGroup({"l0": cpu_kv_parts(caches_, 4)}, slot_dim=2)}, bank=bank,
                         backend="torch", **placement)
        eng.warmup(30)
        held[bool(placement)] = eng.describe()
    assert "page images" in held[False] and "page images" not in held[True], held


def test_rows_permuted_to_the_caches_order_are_staged_in_that_order(backend):
    """A cache holding each head's K then V (``[B, H, N, 2 x head]``) holds a
    canonical bank's row in another element order: the staging gathers each
    row and permutes it there; the bytes equal the device-resident bank's
    (permuted once, at registration)."""
    nb, heads, slots, dim = 7, 2, 8, 4
    bank = Bank({f"l{i}": torch.randn(2, 30, 2 * heads * dim, device="cpu").to(torch.bfloat16) for i in range(2)},
                kv={f"l{i}": (heads, dim, dim) for i in range(2)})
    plan = {"g": GroupFill([2, 3, 4, 0, 6], [0, 0, 2, 0, 0], [8, 8, 8, 8, 5], [0, 8, 16, 24, 32], [1, 1, 0, 1, 0])}
    out = []
    for placement in ({}, {"bank_placement": "host", "staging_bytes": 1}):
        buf = poisoned_buffer(2 * nb * heads * slots * 2 * dim * 2, seed=8)
        caches_ = buf.view(torch.bfloat16).view(2, nb, heads, slots, 2 * dim)
        eng = FillEngine({"g": CacheGroup({f"l{i}": caches_[i] for i in range(2)}, kv=(heads, dim, dim))},
                         bank=bank, backend=backend, **placement)
        assert eng.row_formats()["l0"].order is not None, "the view holds the canonical order: nothing permuted"
        eng.fill(plan)
        assert eng.verify(plan).ok
        out.append(buf)
    assert_same_bytes(out[1], out[0])


def test_a_staging_larger_than_free_device_memory_is_refused_before_any_write(monkeypatch):
    case = _lbnhc()
    buf = poisoned_buffer(case.nbytes(2))
    layers = case.make(buf, torch.bfloat16)
    bank = random_bank(layers, case, torch.bfloat16, lengths=RAGGED)
    monkeypatch.setattr(bank_placement, "free_bytes", lambda device: 100)
    before = buf.clone()
    with pytest.raises(BankError, match=r"staging need .* 100 B are free \(on a GPU: a smaller staging_bytes\)"):
        FillEngine({"g": CacheGroup(layers, num_blocks=NUM_BLOCKS, block_dim=case.block_dim,
                                    slot_dim=case.slot_dim)}, bank=bank, bank_placement="host")
    assert torch.equal(buf, before)


@pytest.mark.parametrize("kw,match", [({"bank_placement": "gpu"}, r"bank_placement 'gpu' is not one of"),
                                      ({"staging_bytes": 0}, r"staging_bytes must be an int >= 1"),
                                      ({"staging_bytes": True}, r"staging_bytes must be an int >= 1")])
def test_a_bad_placement_is_refused_naming_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        FillEngine({"g": CacheGroup({"l": torch.zeros(2, 2, 4, 8)})}, **kw)
