"""Bad input: a clear error naming the value and what was expected; nothing written."""
import pytest
import torch
from oracle import poisoned_buffer

from kvfill.kernels import CacheGroup, DcpGeometry, FillEngine, GroupFill, fill_blocks, layout_of


@pytest.fixture
def cache():
    buf = poisoned_buffer(6 * 2 * 8 * 16 * 2, seed=77)
    return buf, buf.view(torch.bfloat16).view(6, 2, 8, 16)


def engine(t, backend, **kw):
    return FillEngine({"g": CacheGroup({"l0": t}, **kw)}, mean=0.0, std=1.0, backend=backend)


@pytest.mark.parametrize(
    "plan,match",
    [
        (GroupFill(block_ids=[1, 6]), r"entry 1 \(block 6.*0 <= block id < 6"),
        (GroupFill(block_ids=[-1]), r"entry 0 \(block -1.*block id out of range"),
        (GroupFill(block_ids=[2], slot_start=[3], slot_end=[9]), r"slots \[3, 9\).*slot_end <= slots per block 8"),
        (GroupFill(block_ids=[2], slot_start=[-1], slot_end=[4]), r"slot range outside the block"),
        (GroupFill(block_ids=[2], slot_start=[5], slot_end=[4]), r"slot range outside the block"),
        (GroupFill(block_ids=[2], local_base=[-8]), r"negative local_base"),
        (GroupFill(block_ids=[2, 3], slot_start=[0]), r"slot_start has 1 entries, block_ids has 2"),
        (GroupFill(block_ids=[2.5]), r"block_ids must hold integers"),
    ],
)
def test_bad_plan_is_refused_before_any_write(cache, backend, plan, match):
    buf, t = cache
    poison = buf.clone()
    eng = engine(t, backend)
    # A valid first group must not be written either when a later one is bad.
    with pytest.raises(ValueError, match=match):
        eng.fill({"g": plan})
    assert torch.equal(buf, poison)


def test_unregistered_group_is_refused(cache, backend):
    buf, t = cache
    poison = buf.clone()
    with pytest.raises(ValueError, match=r"group 'other'.*registered groups: \['g'\]"):
        engine(t, backend).fill({"g": GroupFill(block_ids=[1]), "other": GroupFill(block_ids=[0])})
    assert torch.equal(buf, poison)


def test_nothing_written_when_a_later_group_is_bad(backend):
    a = torch.zeros(4, 1, 4, 8)
    b = torch.zeros(4, 1, 4, 8)
    eng = FillEngine({"a": CacheGroup({"la": a}), "b": CacheGroup({"lb": b})}, mean=1.0, backend=backend)
    with pytest.raises(ValueError, match="group 'b'"):
        eng.fill({"a": GroupFill(block_ids=[0, 1]), "b": GroupFill(block_ids=[4])})
    assert (a == 0).all() and (b == 0).all()


def test_fill_blocks_out_of_range_names_the_id(cache, backend):
    buf, t = cache
    poison = buf.clone()
    with pytest.raises(ValueError, match=r"block 17.*0 <= block id < 6"):
        fill_blocks([t], [0, 17], backend=backend)
    with pytest.raises(ValueError, match=r"block -2"):
        fill_blocks([t], [-2], backend=backend)
    assert torch.equal(buf, poison)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.float64])
def test_unsupported_dtype_is_refused_at_registration(dtype):
    t = torch.zeros(4, 2, 8, 16, dtype=dtype)
    with pytest.raises(ValueError, match=rf"layer 'l0'.*dtype {dtype}.*not supported|dtype {dtype}"):
        FillEngine({"g": CacheGroup({"l0": t})})
    assert (t == 0).all()


def test_packed_encoding_accepts_any_int_dtype():
    t = torch.full((4, 2, 8, 16), 5, dtype=torch.int32)
    eng = FillEngine({"g": CacheGroup({"l0": t}, encoding="packed")}, mean=1.0)
    eng.fill({"g": GroupFill(block_ids=[2])})
    assert (t[2] == 0).all() and (t[[0, 1, 3]] == 5).all()


def test_overlapping_strides_are_refused_naming_shape_strides_dtype():
    base = torch.zeros(4, 1, 8, 16)
    overlapping = base.expand(4, 3, 8, 16)  # stride 0 over heads
    with pytest.raises(ValueError, match=r"overlapping strides \(shape \(4, 3, 8, 16\), strides \(128, 0, 16, 1\).*float32"):
        layout_of(overlapping)
    weird = torch.zeros(64).as_strided((4, 8, 8), (8, 4, 1))  # slots overlap elements
    with pytest.raises(ValueError, match="overlapping strides"):
        layout_of(weird)


def test_fp8_encoding_needs_a_byte_cache():
    with pytest.raises(ValueError, match=r"encoding 'fp8_e4m3' needs a uint8.*got dtype torch.float16"):
        FillEngine({"g": CacheGroup({"l": torch.zeros(2, 1, 4, 8, dtype=torch.float16)}, encoding="fp8_e4m3")})


def test_bad_engine_arguments():
    t = torch.zeros(2, 1, 4, 8)
    for kw, match in [
        ({"std": -1.0}, r"std must be a finite number >= 0, got -1.0"),
        ({"std": float("nan")}, "std must be a finite number"),
        ({"mean": float("inf")}, "mean must be a finite number"),
        ({"seed": -3}, r"seed must be an int >= 0, got -3"),
        ({"backend": "cuda"}, r"backend 'cuda' is not one of"),
    ]:
        with pytest.raises(ValueError, match=match):
            FillEngine({"g": CacheGroup({"l": t})}, **kw)


@pytest.mark.parametrize(
    "dcp,match",
    [
        ((2, 2, 1), r"world_size=2, rank=2, interleave=1 is invalid"),
        ((0, 0, 1), r"world_size=0"),
        ((2, 0, 0), r"interleave=0"),
        ((2, 0, 3), r"interleave 3 does not divide the block size 8"),
    ],
)
def test_bad_dcp_geometry(dcp, match):
    with pytest.raises(ValueError, match=match):
        FillEngine({"g": CacheGroup({"l": torch.zeros(2, 1, 8, 8)}, dcp=DcpGeometry(*dcp))})


def test_kernel_split_must_divide_block_rows():
    t = torch.zeros(10, 1, 4, 8)
    with pytest.raises(ValueError, match=r"10 entries along block_dim 0.*num_blocks=4"):
        FillEngine({"g": CacheGroup({"l": t}, num_blocks=4)})


def test_layers_of_a_group_must_share_the_block_size():
    with pytest.raises(ValueError, match=r"disagree on the block size.*\[4, 8\]"):
        FillEngine({"g": CacheGroup({"a": torch.zeros(2, 1, 4, 8), "b": torch.zeros(2, 1, 8, 8)})})


def test_a_layer_in_two_groups_is_refused():
    with pytest.raises(ValueError, match="layer 'a' is registered in more than one group"):
        FillEngine({"g": CacheGroup({"a": torch.zeros(2, 1, 4, 8)}), "h": CacheGroup({"a": torch.zeros(2, 1, 4, 8)})})


@pytest.mark.cpu_only
def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        FillEngine({"g": CacheGroup({"l": torch.zeros(2, 1, 4, 8)})}, backend="triton")
