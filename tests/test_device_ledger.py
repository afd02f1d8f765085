"""What a GPU would see and a CPU run does not: the device bytes kvfill
allocates and the host synchronisations it causes, counted by the
accelerator stand-in's ledger (tests/device_rule.py).

The ledger's own rules first (each as CUDA behaves), then kvfill held to
them: a fill step in every mode - synthetic, replay, a host-kept bank,
re-rotation from either placement, DeepSeek's packed rows, recurrent states
- makes no host synchronisation but the documented one (a host-kept bank's
reused pinned buffer, from its third chunk on); and a replaying engine's
device bytes, after registration and at the peak of its fills, are what
its placement counted (``FillEngine.bank_device_bytes``: rows, staging,
rotary tables) and the bookkeeping of its launch tables, never a copy per
layer of a table nor a temporary as large as a chunk.

Each test runs the Triton backend (what a GPU runs) under Triton's
interpreter; the caches are stand-in device tensors, the banks host ones.
The whole file is CPU-only: its stand-in is host memory, over which the GPU
run (no interpreter) refuses Triton; on a GPU the counts are CUDA's own.
"""
import numpy as np
import pytest
import torch
from device_rule import DeviceRule, Ledger, on_device
from oracle import poisoned_buffer
from test_packed_rows import NUM_BLOCKS as PACKED_BLOCKS
from test_packed_rows import entries as packed_entries
from test_packed_rows import group as packed_group
from test_packed_rows import kernel_cache
from test_rerotation import LAYERS, LENGTHS, NB, SLOTS, bank_of, rope_table

from kvfill.kernels import Bank, CacheGroup, FillEngine, GroupFill
from kvfill.kernels import values as V
from kvfill.kernels.state_pages import StatePages

INDEXER_ROW_BYTES = 132  # an indexer token: 128 fp8 values, then its scale's 4 bytes
# Bookkeeping a replaying engine keeps on the device beside what its placement counts: its layer table,
# sequence table and rotary pair indices (a few hundred bytes here), and one step's uploaded plan.
BOOKKEEPING = 16 << 10
# Entries below and past each recorded sequence's end (LENGTHS = [11, 6]): several blocks re-rotated.
ENTRIES = [(1, 0, 8, 0, 0), (2, 0, 8, 8, 0), (5, 0, 8, 32, 0), (3, 0, 8, 0, 1), (6, 0, 8, 16, 1),
           (7, 0, 8, 24, 1)]
TABLE_POSITIONS = 4096  # a table much larger than the bookkeeping: a copy per layer cannot hide in it

# The GPU run (gpu/device_check.sh, no TRITON_INTERPRET) refuses Triton over this file's stand-in, which is
# host memory there: test_device_image.py runs the GPU run's own selection in its stand-in and fails on any
# test here left unmarked.
pytestmark = pytest.mark.cpu_only


def stand_in():
    ledger = Ledger()
    return ledger, DeviceRule(ledger)


# ------------------------------------------------------------ the ledger's rules (as CUDA)
def test_a_blocking_or_pageable_upload_syncs_and_a_pinned_non_blocking_one_does_not():
    ledger, rule = stand_in()
    with rule:
        host = torch.arange(64, device="cpu")
        with ledger.window() as w:
            host.to("cpu:0")
            host.to("cpu:0", non_blocking=True)  # pageable: CUDA stages it and the host waits
            torch.zeros(64, dtype=torch.int64).copy_(host)
        assert [why.split(" ")[0] for why, _ in w.syncs] == ["blocking", "pageable", "blocking"]
        pinned = host.pin_memory()
        with ledger.window() as w:
            on = pinned.to("cpu:0", non_blocking=True)
            torch.zeros(64, dtype=torch.int64).copy_(pinned, non_blocking=True)
            pinned[:8].to("cpu:0", non_blocking=True)  # a view of pinned memory is pinned
        assert w.syncs == [] and on_device(on) and pinned.is_pinned() and not host.is_pinned()


def test_reading_a_device_value_on_the_host_syncs():
    ledger, rule = stand_in()
    with rule:
        t = torch.arange(6)
        mask = t > 2
        for read in (lambda: t.sum().item(), lambda: t.tolist(), lambda: bool(t[0]), lambda: t.cpu(),
                     lambda: t.nonzero(), lambda: t[mask], lambda: torch.equal(t, t),
                     lambda: torch.repeat_interleave(t, t)):
            with ledger.window() as w:
                read()
            assert len(w.syncs) == 1, w.syncs
        index = torch.arange(1, 3)
        with ledger.window() as w:
            (t * 2 + 1).index_select(0, index)  # stays on the device
            torch.repeat_interleave(t, t, output_size=15)
            torch.where(mask, t, 0)
            torch.nn.functional.one_hot(t, num_classes=6)
        assert w.syncs == []


def test_a_device_tensor_made_from_host_data_is_a_blocking_copy():
    """CUDA builds ``torch.tensor(data)`` and ``torch.as_tensor(array,
    device=...)`` in pageable host memory, then copies it blocking."""
    ledger, rule = stand_in()
    with rule:
        with ledger.window() as w:
            on = torch.tensor([1, 2])
            torch.as_tensor(np.arange(4), device="cpu:0")
            torch.tensor(np.arange(4, dtype=np.int64), device="cpu:0")
        assert on_device(on) and [why.split(" ")[0] for why, _ in w.syncs] == ["blocking"] * 3, w.syncs
        with ledger.window() as w:
            torch.tensor([1, 2], device="cpu")  # host data to host memory
            torch.as_tensor(np.arange(4), device="cpu")
        assert w.syncs == []


def test_a_non_blocking_copy_of_a_strided_view_of_pinned_memory_stages_through_pageable_memory():
    """CUDA copies a non-contiguous host side through a contiguous pageable
    temporary, so the host waits although the buffer is pinned (vLLM 0.34's
    gpu_sync_debug says so too); the device makes no temporary unless its own
    side is non-contiguous."""
    ledger, rule = stand_in()
    with rule:
        pinned = torch.empty(4, 16, dtype=torch.int32, device="cpu").pin_memory()
        dst = torch.empty(4, 8, dtype=torch.int32)
        with ledger.window() as w:
            dst.copy_(pinned[:, :8], non_blocking=True)
            pinned[:, :8].to("cpu:0", non_blocking=True)
        assert [why.split(" ")[:2] for why, _ in w.syncs] == [["strided", "pinned"]] * 2, w.syncs
        assert w.temporaries == [], w.temporaries
        with ledger.window() as w:
            torch.empty(4, 16, dtype=torch.int32)[:, :8].copy_(pinned[:, 8:].contiguous().pin_memory(),
                                                                non_blocking=True)
        assert w.syncs == [] and [n for n, _ in w.temporaries] == [4 * 8 * 4]


def test_a_triton_launch_with_a_host_tensor_is_refused_as_on_cuda():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src, dst, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(dst + i, tl.load(src + i))

    _, rule = stand_in()
    with rule:
        out = torch.zeros(8, dtype=torch.int32)
        copy_kernel[(1,)](torch.arange(8, dtype=torch.int32), out, N=8)  # both on the device: runs
        assert out.tolist() == list(range(8))
        with pytest.raises(ValueError, match="cannot be accessed from Triton"):
            copy_kernel[(1,)](torch.arange(8, dtype=torch.int32, device="cpu"), out, N=8)


def test_ops_whose_result_size_or_shape_depends_on_the_values_sync():
    """One-argument ``where`` (nonzero), ``bincount`` (CUDA reads the max on
    the host) and ``one_hot`` without ``num_classes``."""
    ledger, rule = stand_in()
    with rule:
        t = torch.arange(6)
        for read in (lambda: torch.where(t > 2), lambda: torch.bincount(t), lambda: t.bincount(),
                     lambda: torch.nn.functional.one_hot(t)):
            with ledger.window() as w:
                read()
            assert len(w.syncs) == 1, w.syncs


def test_device_bytes_are_counted_until_freed_and_a_strided_copy_makes_a_temporary():
    ledger, rule = stand_in()
    with rule:
        with ledger.window() as w:
            a = torch.empty(1024, dtype=torch.float32)
            b = a[:512] * 2  # a new storage of 2 KiB; the slice is a's
            del b
        assert (w.peak, w.held) == (6144, 4096)
        staging = torch.empty(4, 100, 8, dtype=torch.uint8)
        host = torch.empty(4, 10, 8, dtype=torch.uint8, device="cpu").pin_memory()
        with ledger.window() as w:
            staging[:, :10].copy_(host, non_blocking=True)  # strided target: CUDA copies through a temporary
        assert w.temporaries and w.temporaries[0][0] == 320 and w.syncs == [] and w.peak == 320
        with ledger.window() as w:
            for i in range(4):
                staging[i, :10].copy_(host[i], non_blocking=True)
        assert w.temporaries == [] and w.peak == 0


def test_the_stand_in_pins_where_vllm_cpu_replaced_pin_memory(monkeypatch):
    """vLLM CPU's worker module replaces ``Tensor.pin_memory`` process-wide
    with one returning the tensor itself; after an in-process engine test the
    stand-in's pinning was never asked, and every pinned upload read as
    pageable (CI on a fresh clone).  The rule puts torch's own back while it
    is entered, and the replacement after."""
    def fake(self, *args, **kwargs):
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake)
    test_a_blocking_or_pageable_upload_syncs_and_a_pinned_non_blocking_one_does_not()
    assert torch.Tensor.pin_memory is fake


# ------------------------------------------------------------ kvfill under it
def _engine(kind: str, table_positions: int = TABLE_POSITIONS, layers: int = 4, staging_bytes: int = 1 << 20):
    """An engine of ``layers`` layers on the stand-in device and its plan;
    ``kind``: synthetic, replay, host, rotate, rotate-host."""
    geo = LAYERS["neox"]
    buf = poisoned_buffer(layers * NB * SLOTS * geo.row * 2 + 64, seed=3)
    caches = geo.caches(buf, torch.bfloat16, layers)
    group = CacheGroup({f"l{i}": c for i, c in enumerate(caches)}, kv=geo.kv(), slot_dim=geo.slot_dim)
    plan = {"g": GroupFill(*zip(*ENTRIES))}
    if kind == "synthetic":
        plan = {"g": GroupFill(*list(zip(*ENTRIES))[:4])}  # no sequences without a bank
        return FillEngine({"g": group}, values=V.ValueSpec(std=1.0), backend="triton"), plan
    bank = bank_of(geo, torch.bfloat16, layers=layers)
    rotate = kind.startswith("rotate")
    table = rope_table(table_positions, geo.rotary_dim).to(torch.bfloat16)  # as vLLM keeps it: the model's dtype
    rotary = {f"l{i}": geo.rotary(table) for i in range(layers)} if rotate else None
    placement = "host" if kind.endswith("host") else "device"
    return FillEngine({"g": group}, bank=bank, backend="triton", past_bank="rotate" if rotate else "wrap",
                      rotary=rotary, bank_placement=placement, staging_bytes=staging_bytes), plan


@pytest.mark.parametrize("kind", ["synthetic", "replay", "host", "rotate", "rotate-host"])
def test_a_fill_step_makes_no_host_sync(kind):
    ledger, rule = stand_in()
    with rule:
        engine, plan = _engine(kind)
        engine.fill(plan)  # the first fill as any other: warmup is registration's
        with ledger.window() as w:
            engine.fill(plan)
    assert w.syncs == [], w.syncs
    assert w.temporaries == [], w.temporaries


def test_a_host_banks_only_wait_is_its_reused_pinned_buffer_from_the_third_chunk():
    """Staged one block per chunk (staging_bytes 1): six chunks, two pinned
    buffers, so chunks 3 to 6 each wait for the copy out of the buffer they
    reuse - and nothing else waits."""
    ledger, rule = stand_in()
    with rule:
        plan = {"g": GroupFill(*zip(*ENTRIES))}
        geo = LAYERS["neox"]
        buf = poisoned_buffer(2 * NB * SLOTS * geo.row * 2 + 64, seed=5)
        group = CacheGroup({f"l{i}": c for i, c in enumerate(geo.caches(buf, torch.bfloat16, 2))}, kv=geo.kv(),
                           slot_dim=geo.slot_dim)
        engine = FillEngine({"g": group}, bank=bank_of(geo, torch.bfloat16), backend="triton",
                            bank_placement="host", staging_bytes=1)
        with ledger.window() as w:
            engine.fill(plan)
    assert [why for why, _ in w.syncs] == ["event wait"] * (len(ENTRIES) - 2), w.syncs


def test_packed_rows_and_recurrent_states_are_written_without_a_host_sync():
    ledger, rule = stand_in()
    with rule:
        g = torch.Generator(device="cpu").manual_seed(1)
        rows = torch.randint(0, 255, (150, INDEXER_ROW_BYTES), dtype=torch.uint8, generator=g, device="cpu")
        engine = FillEngine(packed_group(kernel_cache(INDEXER_ROW_BYTES, seed=2)),
                            bank=Bank({"idx": rows}, sequence_lengths=[150]), backend="triton")
        plan = {"g": packed_entries([3, 1], 150)}
        engine.fill(plan)
        cache = torch.full((5, 1, 1, 128), -7, dtype=torch.int8)
        pages = torch.randint(-100, 100, (3, 128), dtype=torch.int8, generator=g, device="cpu")
        states = StatePages({"s": cache}, {"s": pages})
        blocks = {"s": (np.array([3, 0]), np.array([1, 2]))}
        states.write(blocks)
        with ledger.window() as w:
            engine.fill(plan)
            states.write(blocks)
    assert w.syncs == [], w.syncs
    assert PACKED_BLOCKS == 4


@pytest.mark.parametrize("kind,staging", [("replay", 1 << 20), ("rotate", 1 << 20), ("rotate-host", 1 << 20),
                                          ("rotate", 1), ("rotate-host", 1)])
def test_a_replaying_engines_device_bytes_are_what_its_placement_counted(kind, staging):
    """After registration the engine holds what its placement counted
    (``bank_device_bytes``) plus a little bookkeeping; its fills' peak above
    that is at most one step's plan.  Re-rotating, the rotary table is one
    float32 copy for every layer (TABLE_POSITIONS x 16 x 4 bytes = 256 KiB),
    counted; a copy per layer would be 768 KiB more.  Staged one block per
    chunk (``staging`` 1), every chunk fills the staging: the turn's
    temporaries at their largest."""
    ledger, rule = stand_in()
    with rule:
        with ledger.window() as registration:
            engine, plan = _engine(kind, staging_bytes=staging)
        with ledger.window() as fills:
            engine.fill(plan)
            engine.fill(plan)
    counted, transient = engine.bank_device_bytes
    tables = TABLE_POSITIONS * 16 * 4 if kind.startswith("rotate") else 0
    assert counted >= tables and (transient > 0) == kind.startswith("rotate")
    caches = LAYERS["neox"].row * 4 * NB * SLOTS * 2 + 64
    held = registration.held - caches
    assert counted <= held <= counted + BOOKKEEPING, registration.allocations
    assert fills.peak <= transient + BOOKKEEPING and fills.temporaries == [], (fills.allocations, fills.temporaries)
    assert LENGTHS == [11, 6]


# ------------------------------------------------------------ the checks can fail
def _per_layer_table(table, device, made):
    return table.to(device=device, dtype=torch.float32)  # G1 as it was: each layer its own copy


@pytest.mark.parametrize("defect", ["G1 a table per layer", "G4 blocking uploads", "G6 a strided chunk copy"])
def test_each_gpu_only_defect_put_back_fails_its_ledger_check(defect, monkeypatch):
    """The review's G1, G4 and G6 (issue 59) as the code had them: each fails
    the check above that holds kvfill to what a GPU would do."""
    from kvfill.kernels import rotary, staging

    if defect.startswith("G1"):
        monkeypatch.setattr(rotary, "device_table", _per_layer_table)
        check = lambda: test_a_replaying_engines_device_bytes_are_what_its_placement_counted("rotate", 1 << 20)  # noqa: E731
    elif defect.startswith("G4"):
        monkeypatch.setattr(staging, "upload", lambda host, device: host.to(device))
        check = lambda: test_a_fill_step_makes_no_host_sync("rotate")  # noqa: E731
    else:
        monkeypatch.setattr(staging, "copy_rows", lambda dst, src: dst.copy_(src, non_blocking=True))
        check = lambda: test_a_fill_step_makes_no_host_sync("host")  # noqa: E731
    with pytest.raises(AssertionError):
        check()
