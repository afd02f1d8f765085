"""Fuzzing: random layouts, dtypes and plans; every byte compared with the oracle.

CI runs a bounded number of examples; ``KVFILL_FUZZ_EXAMPLES=2000 make test``
(or ``pytest tests/test_fuzz.py``) runs a longer campaign.
"""
import math
import os

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import dcp_position, poisoned_buffer, row_bits, write_expected

from kvfill.kernels import CacheGroup, DcpGeometry, FillEngine, GroupFill
from kvfill.kernels import values as V

EXAMPLES = int(os.environ.get("KVFILL_FUZZ_EXAMPLES", "200"))

DTYPES = [
    (torch.float32, "auto"),
    (torch.float16, "auto"),
    (torch.bfloat16, "auto"),
    (torch.float8_e4m3fn, "auto"),
    (torch.float8_e5m2, "auto"),
    (torch.uint8, "fp8_e4m3"),
    (torch.uint8, "fp8_e5m2"),
    (torch.float8_e4m3fnuz, "auto"),
    (torch.uint8, "fp8_e4m3fnuz"),
    (torch.uint8, "packed"),
]


@st.composite
def layouts(draw):
    """A strided cache: logical dims (block, maybe slot, elements), any physical
    order, padding between dims, a storage offset, maybe kernel-block split."""
    nb = draw(st.integers(1, 5))
    has_slot = draw(st.booleans())
    bs = draw(st.sampled_from([1, 2, 4, 8])) if has_slot else 1
    split = draw(st.sampled_from([r for r in (1, 2) if bs % r == 0])) if has_slot else 1
    elems = draw(st.lists(st.integers(1, 5), min_size=0 if has_slot else 1, max_size=3))
    kinds = ["block"] + (["slot"] if has_slot else []) + ["elem"] * len(elems)
    order = draw(st.permutations(range(len(kinds))))  # logical positions of the kinds
    logical = [None] * len(kinds)
    sizes_by_kind = {"block": nb * split, "slot": bs // split}
    e_iter = iter(elems)
    for kind, pos in zip(kinds, order):
        logical[pos] = (kind, sizes_by_kind[kind] if kind != "elem" else next(e_iter))
    shape = [size for _, size in logical]
    phys = draw(st.permutations(range(len(shape))))  # physical order, outermost first
    pads = [draw(st.integers(0, 2)) for _ in shape]
    strides = [0] * len(shape)
    step = 1
    for d in reversed(phys):
        strides[d] = step
        step *= shape[d] + pads[d]
    offset = draw(st.integers(0, 7))
    kinds_in_order = [k for k, _ in logical]
    return {
        "shape": shape,
        "strides": strides,
        "offset": offset,
        "numel": offset + step + 8,
        "block_dim": kinds_in_order.index("block"),
        "slot_dim": kinds_in_order.index("slot") if has_slot else None,
        "num_blocks": nb,
        "block_size": bs,
        "split": split,
    }


def make_views(buf, dtype, lay, num_layers):
    typed = buf.view(dtype)
    per = lay["numel"]
    return {
        f"l{i}": typed.as_strided(lay["shape"], lay["strides"], i * per + lay["offset"])
        for i in range(num_layers)
    }


@st.composite
def plans(draw, lay):
    nb, bs = lay["num_blocks"], lay["block_size"]
    ids = draw(st.lists(st.integers(0, nb - 1), min_size=0, max_size=nb, unique=True))
    entries = []
    for b in ids:
        s0 = draw(st.integers(0, bs))
        s1 = draw(st.integers(s0, bs))
        base = draw(st.integers(0, 40)) * bs
        entries.append((b, s0, s1, base))
    if bs > 1 and lay["slot_dim"] is not None:
        world = draw(st.sampled_from([1, 2, 4]))
        interleave = draw(st.sampled_from([i for i in (1, 2, 4, 8) if bs % i == 0]))
        rank = draw(st.integers(0, world - 1))
    else:
        world, interleave, rank = 1, 1, 0
    return entries, (world, rank, interleave)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_layouts_and_plans_write_exactly_the_planned_slots(data):
    lay = data.draw(layouts())
    dtype, encoding = data.draw(st.sampled_from(DTYPES))
    num_layers = data.draw(st.integers(1, 2))
    std = data.draw(st.sampled_from([0.0, 1.0]))
    backend = data.draw(st.sampled_from(["torch", "triton"]))
    entries, (world, rank, interleave) = data.draw(plans(lay))
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = poisoned_buffer(lay["numel"] * num_layers * itemsize, seed=data.draw(st.integers(0, 99)))
    expected = buf.clone()
    views = make_views(buf, dtype, lay, num_layers)

    engine = FillEngine(
        {"g": CacheGroup(views, num_blocks=lay["num_blocks"], block_dim=lay["block_dim"],
                         slot_dim=lay["slot_dim"], encoding=encoding,
                         dcp=DcpGeometry(world, rank, interleave))},
        mean=0.3, std=std, seed=4, backend=backend,
    )
    if entries:
        b, lo, hi, base = (np.array(x) for x in zip(*entries))
        engine.fill({"g": GroupFill(b, lo, hi, base)})

    vdtype = V.value_dtype(dtype, encoding)
    mode = V.ZERO if vdtype is None else (V.NORMAL if std > 0 else V.CONSTANT)
    ev = make_views(expected, dtype, lay, num_layers)
    per_block = lay["shape"][lay["block_dim"]] * (lay["shape"][lay["slot_dim"]] if lay["slot_dim"] is not None else 1)
    row = math.prod(lay["shape"]) // per_block
    for layer, view in enumerate(ev.values()):
        for blk, s0, s1, base in entries:
            for s in range(s0, s1):
                bits = row_bits(mode=mode, mean=0.3, std=std, seed=4, layer=layer,
                                position=dcp_position(base + s, world, rank, interleave),
                                row_size=row, vdtype=vdtype, itemsize=itemsize)
                write_expected(view, block_dim=lay["block_dim"], slot_dim=lay["slot_dim"],
                               kernel_split=lay["split"], block=blk, slot=s, bits=bits)
    diff = (buf != expected).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} bytes differ (stray or missed writes), first {diff[:8].tolist()}"
