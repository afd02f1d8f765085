"""Every layout x every dtype x both backends, in poisoned memory: the planned
slots hold the value function's bits and every other byte is unchanged."""
import pytest
import torch
from cases import BUILT_CASES, CASE_IDS, CASES, DTYPES, NUM_BLOCKS, VLLM_CASES
from oracle import poisoned_buffer, row_bits, write_expected

from kvfill.kernels import CacheGroup, FillEngine, GroupFill
from kvfill.kernels import values as V

MEAN, STD, SEED = 0.25, 0.5, 11

# (block, slot_start, slot_end, local_base): a partial first block, a whole
# block and a partial last block of one request, placed out of order.
SLOT_ENTRIES = [(4, 3, 8, 0), (1, 0, 8, 8), (5, 0, 2, 16)]
STATE_ENTRIES = [(4, 0, 1, 7), (2, 0, 1, 9)]


def _row_size(t, block_dim, slot_dim):
    per = t.shape[block_dim] * (t.shape[slot_dim] if slot_dim is not None else 1)
    return t.numel() // per


def expected_fill(layers, case, dtype, encoding, entries, *, mode, mean=MEAN, std=STD, seed=SEED, dcp=(1, 0, 1)):
    """Apply the oracle's writes to ``layers`` (views over the expected buffer)."""
    from oracle import dcp_position

    vdtype = V.value_dtype(dtype, encoding)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for layer_id, caches in enumerate(layers.values()):
        tensors = caches if isinstance(caches, list) else [caches]
        elem_offset = 0
        for t in tensors:
            row = _row_size(t, case.block_dim, case.slot_dim)
            for block, lo, hi, base in entries:
                for s in range(lo, hi):
                    bits = row_bits(
                        mode=mode if vdtype is not None else V.ZERO,
                        mean=mean,
                        std=std,
                        seed=seed,
                        layer=layer_id,
                        position=dcp_position(base + s, *dcp),
                        row_size=row,
                        vdtype=vdtype,
                        itemsize=itemsize,
                        elem_offset=elem_offset,
                    )
                    write_expected(
                        t,
                        block_dim=case.block_dim,
                        slot_dim=case.slot_dim,
                        kernel_split=case.kernel_split,
                        block=block,
                        slot=s,
                        bits=bits,
                    )
            elem_offset += row


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    diff = (actual != expected).nonzero().flatten()
    assert diff.numel() == 0, (
        f"{diff.numel()} byte(s) differ from the oracle, first at byte offsets {diff[:8].tolist()}"
    )


def make_engine(layers, case, encoding, backend, *, std=STD, mean=MEAN, seed=SEED, **group_kw):
    group = CacheGroup(
        layers,
        num_blocks=NUM_BLOCKS,
        block_dim=case.block_dim,
        slot_dim=case.slot_dim,
        encoding=encoding,
        **group_kw,
    )
    return FillEngine({"g": group}, mean=mean, std=std, seed=seed, backend=backend)


def plan_of(entries):
    blocks, lo, hi, base = zip(*entries)
    return {"g": GroupFill(block_ids=blocks, slot_start=lo, slot_end=hi, local_base=base)}


@pytest.mark.parametrize("dtype_case", DTYPES, ids=[d[0] for d in DTYPES])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fill_writes_planned_slots_and_nothing_else(case, dtype_case, backend):
    check_fill(case, dtype_case, backend)


@pytest.mark.parametrize("dtype_case", DTYPES, ids=[d[0] for d in DTYPES])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_torch_backend_per_entry_path_writes_the_same(case, dtype_case, monkeypatch):
    """The torch backend writes large entries one copy each; force that path."""
    from kvfill.kernels import torch_fill

    monkeypatch.setattr(torch_fill, "PER_ENTRY_BYTES", 0)
    check_fill(case, dtype_case, "torch")


@pytest.mark.parametrize("dtype_case", DTYPES, ids=[d[0] for d in DTYPES])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_torch_backend_page_paths_write_the_same(case, dtype_case, monkeypatch):
    """Whole pages (here: of any size) take the one-pass gather or the staged
    copy, the partial entries beside them the per-entry copy."""
    from kvfill.kernels import torch_fill, torch_pages

    monkeypatch.setattr(torch_pages, "PAGE_BYTES", 0)
    monkeypatch.setattr(torch_fill, "PER_ENTRY_BYTES", 0)
    check_fill(case, dtype_case, "torch")


def check_fill(case, dtype_case, backend):
    _, dtype, encoding = dtype_case
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = poisoned_buffer(case.nbytes(itemsize))
    poison = buf.clone()
    expected = buf.clone()
    layers = case.make(buf, dtype)
    entries = STATE_ENTRIES if case.state_list else SLOT_ENTRIES

    engine = make_engine(layers, case, encoding, backend)
    stats = engine.fill(plan_of(entries))

    expected_fill(case.make(expected, dtype), case, dtype, encoding, entries, mode=V.NORMAL)
    assert_same_bytes(buf, expected)
    assert (buf != poison).any(), "the fill wrote nothing"
    assert stats.slots == sum(hi - lo for _, lo, hi, _ in entries) * sum(
        len(c) if isinstance(c, list) else 1 for c in layers.values()
    )
    assert stats.launches == (engine.num_launch_classes if backend == "triton" else 0)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("vllm-LBNHC", "vllm-BHLNC", "mamba-states")], ids=lambda c: c.name)
def test_constant_mode_writes_mean_rounded_to_dtype(case, backend):
    dtype = torch.bfloat16
    buf = poisoned_buffer(case.nbytes(2))
    expected = buf.clone()
    layers = case.make(buf, dtype)
    entries = STATE_ENTRIES if case.state_list else SLOT_ENTRIES
    engine = make_engine(layers, case, "auto", backend, std=0.0, mean=0.015)
    engine.fill(plan_of(entries))
    expected_fill(case.make(expected, dtype), case, dtype, "auto", entries, mode=V.CONSTANT, mean=0.015, std=0.0)
    assert_same_bytes(buf, expected)
    first = next(iter(layers.values()))
    first = first[0] if isinstance(first, list) else first
    idx = [0] * first.dim()
    idx[case.block_dim] = entries[0][0]
    if case.slot_dim is not None:
        idx[case.slot_dim] = entries[0][1]
    assert first[tuple(idx)].item() == torch.tensor(0.015, dtype=torch.bfloat16).item()


@pytest.mark.parametrize("case", VLLM_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_gpu_check_layouts_equal_vllm_views(case, dtype):
    """kvfill.kernels.testing (the GPU check's cases, built where vLLM is absent) builds vLLM's exact views."""
    built = {c.name: c for c in BUILT_CASES}[case.name.replace("vllm-", "std-").replace("std-LBNHC-", "LBNHC-")]
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = torch.zeros(case.nbytes(itemsize), dtype=torch.uint8)
    ours, theirs = built.make(buf, dtype), case.make(buf, dtype)
    assert ours.keys() == theirs.keys()
    for name in ours:
        a, b = ours[name], theirs[name]
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(), b.dtype)


@pytest.mark.parametrize("dcp", [(1, 0, 1), (2, 1, 4)], ids=["no-dcp", "dcp2-rank1-i4"])
def test_gpu_sized_tiles_loop_over_long_rows_and_partial_slot_ranges(monkeypatch, dcp):
    """On a GPU a program stores 4096 elements per tile (1024 along the row), so
    a 2304-element row takes three column tiles (the last one masked) and a
    16-slot block four slot tiles.  The interpreter's larger default tile never
    loops: force the GPU's sizes and compare with the torch backend."""
    from kvfill.kernels import DcpGeometry, triton_fill

    monkeypatch.setattr(triton_fill, "TILE_NUMEL", 4096)
    monkeypatch.setattr(triton_fill, "MAX_TILE_ELEMS", 1024)
    shape = (5, 8, 16, 288)  # [B, H, N, C]: rows of 8 x 288 = 2304 elements
    lay_probe = torch.empty(shape, dtype=torch.bfloat16)
    from kvfill.kernels import layout_of

    assert triton_fill.tile_shape(layout_of(lay_probe)) == (4, 1024)
    nbytes = 2 * torch.empty(shape).numel() * 2
    plan = {"g": GroupFill(block_ids=[3, 0, 4], slot_start=[3, 0, 1], slot_end=[14, 16, 6],
                           local_base=[0, 16, 32])}
    out = []
    for backend in ("triton", "torch"):
        buf = poisoned_buffer(nbytes, seed=21)
        t = buf.view(torch.bfloat16).view(2, *shape)
        eng = FillEngine({"g": CacheGroup({"l0": t[0], "l1": t[1]}, dcp=DcpGeometry(*dcp))},
                         mean=0.0, std=1.0, seed=4, backend=backend)
        eng.fill(plan)
        assert eng.verify(plan).ok
        out.append(buf)
    assert torch.equal(out[0], out[1])
    assert not torch.equal(out[0], poisoned_buffer(nbytes, seed=21))


@pytest.mark.parametrize("layout", ["vllm-cpu-2BHND", "std-LBNHC"])
def test_whole_pages_written_in_one_pass_equal_the_oracle(monkeypatch, layout):
    """Whole-page entries of a layout whose (heads, slots, head_dim) region is
    contiguous - vLLM CPU's (2, num_blocks, H, N, D) - are gathered straight
    into the cache (no staging buffer); other layouts take the per-entry copy.
    Both must store the oracle's bytes and nothing else."""
    from oracle import row_bits, write_expected

    from kvfill.kernels import torch_fill, torch_pages

    monkeypatch.setattr(torch_fill, "PER_ENTRY_BYTES", 0)
    monkeypatch.setattr(torch_pages, "PAGE_BYTES", 0)  # tiny test pages take the page paths too
    nb, heads, slots, dim = 6, 2, 8, 4
    buf = poisoned_buffer(2 * nb * heads * slots * dim * 2 * 2, seed=31)
    expected = buf.clone()

    def views(b):
        t = b.view(torch.bfloat16)
        if layout == "vllm-cpu-2BHND":
            return {f"layer.{i}": t.view(2, 2, nb, heads, slots, dim)[i] for i in range(2)}, 1, 3
        return {f"layer.{i}": t.view(2, nb, slots, heads, 2 * dim)[i].transpose(1, 2) for i in range(2)}, 0, 2

    layers, block_dim, slot_dim = views(buf)
    eng = FillEngine({"g": CacheGroup(layers, block_dim=block_dim, slot_dim=slot_dim)}, mean=MEAN, std=STD,
                     seed=SEED, backend="torch")
    ids = [1, 2, 3, 5, 0]  # a run of consecutive blocks (one gather on vLLM CPU's layout), then others
    eng.fill({"g": GroupFill(ids)})
    ev, _, _ = views(expected)
    for layer_id, v in enumerate(ev.values()):
        for k, b in enumerate(ids):
            for s in range(slots):
                bits = row_bits(mode=V.NORMAL, mean=MEAN, std=STD, seed=SEED, layer=layer_id, position=k * slots + s,
                                row_size=v.numel() // (nb * slots), vdtype=torch.bfloat16, itemsize=2)
                write_expected(v, block_dim=block_dim, slot_dim=slot_dim, kernel_split=1, block=b, slot=s, bits=bits)
    assert_same_bytes(buf, expected)
