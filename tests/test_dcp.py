"""DCP: W ranks' slots, reassembled token by token, equal the W = 1 fill."""
import pytest
import torch
from oracle import poisoned_buffer

from kvfill.kernels import CacheGroup, DcpGeometry, FillEngine, GroupFill

BS, NUM_BLOCKS, HEADS, C = 8, 12, 2, 8
NUM_TOKENS, LOCAL = 70, 5  # external tokens [LOCAL, NUM_TOKENS - 1)
TABLE = [3, 0, 5, 1, 7, 2, 9, 4, 11, 6]


# name -> (per-layer shape, block dim, slots of block b: view -> tensor)
LAYOUTS = {
    "standard-BHNC": ((NUM_BLOCKS, HEADS, BS, C), 0, lambda v, b, s: v[b, :, s]),
    "flash-attn-2xB": ((2, NUM_BLOCKS, BS, HEADS, C // 2), 1, lambda v, b, s: v[:, b, s]),
}


def caches(seed, layout="standard-BHNC"):
    shape = LAYOUTS[layout][0]
    buf = poisoned_buffer(2 * NUM_BLOCKS * HEADS * BS * C * 2, seed)
    t = buf.view(torch.float16).view(2, *shape)
    return buf, {"layer.0": t[0], "layer.1": t[1]}


def owner_and_local(t, world, interleave):
    return (t // interleave) % world, (t // (interleave * world)) * interleave + t % interleave


def rank_entries(world, rank, interleave):
    """Brute force: the rank-local slots of the external tokens, as entries."""
    locals_ = [
        loc
        for t in range(LOCAL, NUM_TOKENS - 1)
        for r, loc in [owner_and_local(t, world, interleave)]
        if r == rank
    ]
    if not locals_:
        return []
    lo, hi = min(locals_), max(locals_) + 1
    assert hi - lo == len(locals_), "a rank's external tokens are one contiguous local range"
    return [
        (TABLE[k], max(lo - k * BS, 0), min(hi - k * BS, BS), k * BS)
        for k in range(lo // BS, -(-hi // BS))
    ]


def run(world, rank, interleave, backend, buf_seed, layout="standard-BHNC"):
    buf, layers = caches(buf_seed, layout)
    poison = buf.clone()
    block_dim = LAYOUTS[layout][1]
    eng = FillEngine(
        {"full": CacheGroup(layers, block_dim=block_dim, slot_dim=2, dcp=DcpGeometry(world, rank, interleave))},
        mean=0.0,
        std=1.0,
        seed=21,
        backend=backend,
    )
    entries = rank_entries(world, rank, interleave)
    if entries:
        b, lo, hi, base = zip(*entries)
        eng.fill({"full": GroupFill(block_ids=b, slot_start=lo, slot_end=hi, local_base=base)})
    return buf, poison, layers, entries


def slot_bytes(layers, block, slot, layout="standard-BHNC"):
    pick = LAYOUTS[layout][2]
    return torch.stack([pick(layers[n], block, slot).contiguous().view(torch.uint8) for n in layers])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("interleave", [1, BS // 2, BS])
def test_ranks_reassembled_equal_single_rank_fill(world, interleave, backend, layout):
    _, _, ref, _ = run(1, 0, 1, backend, buf_seed=100, layout=layout)
    ranks = [run(world, r, interleave, backend, buf_seed=200 + r, layout=layout) for r in range(world)]
    for t in range(LOCAL, NUM_TOKENS - 1):
        r, loc = owner_and_local(t, world, interleave)
        got = slot_bytes(ranks[r][2], TABLE[loc // BS], loc % BS, layout)
        want = slot_bytes(ref, TABLE[t // BS], t % BS, layout)
        assert torch.equal(got, want), f"token {t} on rank {r} (local {loc})"
    # Nothing outside the planned slots changed on any rank: copying the
    # planned slots into the poisoned original must give the buffer back.
    shape, _, pick = LAYOUTS[layout]
    for buf, poison, _, entries in ranks:
        restored = poison.clone()
        before = restored.view(torch.float16).view(2, *shape)
        after = buf.view(torch.float16).view(2, *shape)
        for b, lo, hi, _ in entries:
            for layer in range(2):
                pick(before[layer], b, slice(lo, hi)).copy_(pick(after[layer], b, slice(lo, hi)))
        assert torch.equal(restored, buf), "stray write outside the planned slots"
