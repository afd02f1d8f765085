"""The planner against a brute-force replay of vLLM's slot mapping."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfill.connector.planner import NULL_BLOCK_ID, GroupGeometry, GroupKind, Planner
from kvfill.kernels import DcpGeometry, FillPlan


def replay_slots(geo: GroupGeometry, table, lo, hi):
    """vLLM's slot mapping, token by token (vllm/v1/worker/block_table.py):
    {rank: {(block, slot): token}} for the tokens [lo, hi)."""
    W, I, bs = geo.dcp.world_size, geo.dcp.interleave, geo.block_size
    out = {r: {} for r in range(W)}
    for t in range(lo, hi):
        vb, off = divmod(t, bs * W)
        rank = (off // I) % W
        local_off = (off // (W * I)) * I + off % I
        block = table[vb]
        if block == NULL_BLOCK_ID:
            continue
        out[rank][(block, local_off)] = t
    return out


def planned_slots(plan: FillPlan, geo, rank):
    """{(block, slot): global token} from the planner's entries on one rank."""
    if geo.name not in plan:
        return {}
    g = plan[geo.name]
    W, I = geo.dcp.world_size, geo.dcp.interleave
    out = {}
    for b, s0, s1, base in zip(g.block_ids, g.slot_start, g.slot_end, g.local_base):
        for s in range(s0, s1):
            local = base + s
            t = (local // I) * (I * W) + rank * I + local % I if W > 1 else local
            key = (int(b), int(s))
            assert key not in out, f"slot {key} planned twice"
            out[key] = int(t)
    return out


@st.composite
def scenario(draw):
    bs = draw(st.sampled_from([4, 8, 16]))
    n_groups = draw(st.integers(1, 3))
    dcp = draw(st.sampled_from([1, 2, 4, 8]))  # one DCP world for all sharded groups, as in vLLM
    groups = []
    for gi in range(n_groups):
        kind = draw(st.sampled_from([GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.CHUNKED_LOCAL]))
        gbs = draw(st.sampled_from([bs, 2 * bs, bs // 2 if bs > 4 else bs]))
        # vLLM resolves W per spec: chunked local and sliding window are sharded in 0.32.
        W = dcp if kind == GroupKind.FULL_ATTENTION or draw(st.booleans()) else 1
        I = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16) if gbs % d == 0]))
        groups.append(GroupGeometry(f"g{gi}", kind, gbs, DcpGeometry(W, 0, I)))
    num_tokens = draw(st.integers(1, 300))
    local = draw(st.integers(0, num_tokens - 1))
    tables = []
    for geo in groups:
        need = -(-(num_tokens - 1) // geo.span)
        extra = draw(st.integers(0, 2))
        ids = draw(st.lists(st.integers(1, 10_000), min_size=need + extra, max_size=need + extra, unique=True))
        # Null padding: sliding windows and chunked local null out early blocks.
        if geo.kind != GroupKind.FULL_ATTENTION and ids:
            n_null = draw(st.integers(0, len(ids)))
            ids = [NULL_BLOCK_ID] * n_null + ids[n_null:]
        tables.append(ids)
    return groups, num_tokens, local, tables


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_every_external_slot_is_planned_on_its_rank_and_nothing_else(s):
    groups, num_tokens, local, tables = s
    planner = Planner(groups)
    sel = planner.select("r0", num_tokens, local, tables)
    assert sel.num_external_tokens == num_tokens - 1 - local
    world = max(g.dcp.world_size for g in groups)
    for rank in range(world):
        plan = planner.for_rank(rank).plan([sel])
        for geo, table in zip(groups, tables):
            want = replay_slots(geo, table, local, num_tokens - 1)
            # Unsharded groups (W = 1) hold every token on every rank.
            assert planned_slots(plan, geo, rank) == want[rank if geo.dcp.sharded else 0], (geo, rank)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 500), st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8, 16]))
def test_local_count_matches_brute_force(n, world, interleave):
    for rank in range(world):
        brute = sum(1 for t in range(n) if (t // interleave) % world == rank)
        assert DcpGeometry(world, rank, interleave).local_count(n) == brute


def test_the_dcp_fix_case():
    """Block size 16, W = 2: full attention spans 32 tokens a block, sliding
    window 16; 33 external tokens -> ([1, 2], [5, 6, 7])."""
    planner = Planner([
        GroupGeometry("full", GroupKind.FULL_ATTENTION, 16, DcpGeometry(world_size=2)),
        GroupGeometry("swa", GroupKind.SLIDING_WINDOW, 16),
    ])
    sel = planner.select("req", num_tokens=34, num_local_computed=0, block_ids=[[1, 2, 3], [5, 6, 7, 8]])
    assert sel.intree_view() == (([1, 2], [5, 6, 7]), 33)


def test_several_requests_concatenate_in_request_order():
    geo = GroupGeometry("full", GroupKind.FULL_ATTENTION, 4)
    planner = Planner([geo])
    a = planner.select("a", 10, 2, [[7, 8, 9]])   # tokens [2, 9)
    b = planner.select("b", 5, 0, [[3, 4]])       # tokens [0, 4)
    g = planner.plan([a, b])["full"]
    assert g.block_ids.tolist() == [7, 8, 9, 3]
    assert g.slot_start.tolist() == [2, 0, 0, 0]
    assert g.slot_end.tolist() == [4, 4, 1, 4]
    assert g.local_base.tolist() == [0, 4, 8, 0]


def test_block_granularity_fills_whole_blocks_like_in_tree():
    geo = GroupGeometry("full", GroupKind.FULL_ATTENTION, 4)
    planner = Planner([geo], granularity="block")
    g = planner.plan([planner.select("a", 10, 2, [[7, 8, 9]])])["full"]
    assert g.block_ids.tolist() == [7, 8, 9]
    assert g.slot_start.tolist() == [0, 0, 0] and g.slot_end.tolist() == [4, 4, 4]


def test_circular_buffer_takes_all_non_null_blocks_whole_and_zeroed():
    geo = GroupGeometry("ring", GroupKind.CIRCULAR_BUFFER, 8)
    assert geo.zero
    planner = Planner([geo])
    g = planner.plan([planner.select("a", 100, 40, [[NULL_BLOCK_ID, 5]])])["ring"]
    assert g.block_ids.tolist() == [5] and g.slot_start.tolist() == [0] and g.slot_end.tolist() == [8]


def test_mamba_fills_the_request_state_rows():
    geo = GroupGeometry("mamba", GroupKind.MAMBA, 64)
    planner = Planner([geo])
    g = planner.plan([planner.select("a", 130, 0, [[NULL_BLOCK_ID, NULL_BLOCK_ID, 9]])])["mamba"]
    assert g.block_ids.tolist() == [9] and (g.slot_start.tolist(), g.slot_end.tolist()) == ([0], [1])
    assert g.local_base.tolist() == [128]  # the state after the last external token


def test_the_state_block_is_the_block_of_the_last_prompt_token_even_past_the_filled_range():
    """vLLM reads a request's state from the block of its last token (mamba
    cache mode align: the running block, null blocks before it): with the
    fill ending at a block boundary that block lies past the filled tokens."""
    geo = GroupGeometry("mamba", GroupKind.MAMBA, 64)
    planner = Planner([geo])
    sel = planner.select("a", 129, 0, [[NULL_BLOCK_ID, NULL_BLOCK_ID, 9]])
    g = planner.plan([sel])["mamba"]
    assert g.block_ids.tolist() == [9] and g.local_base.tolist() == [127]
    assert planner.select("b", 1, 0, [[9]]).groups[0].block_ids == ()  # nothing filled, no state written
    with pytest.raises(ValueError, match="state block of position 128 is block 2 of span 64, but only 2"):
        planner.select("c", 129, 0, [[NULL_BLOCK_ID, 9]])


@pytest.mark.parametrize("num_tokens,local", [(1, 0), (2, 0), (2, 1), (5, 4)])
def test_nothing_external_plans_nothing(num_tokens, local):
    geo = GroupGeometry("full", GroupKind.FULL_ATTENTION, 4, DcpGeometry(world_size=2))
    planner = Planner([geo])
    sel = planner.select("a", num_tokens, local, [[3, 4]])
    assert sel.num_external_tokens == max(num_tokens - 1 - local, 0)
    for rank in range(2):
        plan = planner.for_rank(rank).plan([sel])
        want = 1 if (num_tokens, local, rank) == (2, 0, 0) else 0
        assert (plan["full"].num_slots if "full" in plan else 0) == want
        assert ("full" in plan) == bool(want)  # groups without entries are left out


@pytest.mark.parametrize(
    "args,match",
    [
        (("r9", 100, 0, [[1, 2]]), r"request 'r9', group 'full': tokens \[0, 99\) need blocks \[0, 4\) of span 32 .*only 2 are allocated"),
        (("r1", -4, 0, [[1]]), r"request 'r1': negative token count \(num_tokens=-4"),
        (("r1", 10, -1, [[1]]), r"negative token count"),
        (("r2", 10, 12, [[1]]), r"request 'r2': num_local_computed=12 exceeds the 9 tokens"),
        (("r3", 10, 0, [[1], [2]]), r"block ids for 2 groups, the planner has 1"),
    ],
)
def test_bad_requests_are_refused_with_names_and_numbers(args, match):
    planner = Planner([GroupGeometry("full", GroupKind.FULL_ATTENTION, 16, DcpGeometry(world_size=2))])
    with pytest.raises(ValueError, match=match):
        planner.select(*args)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"block_size": 16, "dcp": DcpGeometry(2, 0, 3)}, r"group 'g': interleave 3 does not divide the block size 16"),
        ({"block_size": 0}, r"block_size must be an int >= 1, got 0"),
        ({"block_size": 16, "dcp": (2, 0, 1)}, r"dcp must be a DcpGeometry, got tuple"),
        ({"block_size": 16, "dcp": DcpGeometry(2), "kind": GroupKind.MAMBA},
         r"Mamba state is not sharded by DCP"),
    ],
)
def test_bad_geometry_is_refused(kw, match):
    kw = {"kind": GroupKind.FULL_ATTENTION, **kw}
    with pytest.raises((ValueError, TypeError), match=match):
        GroupGeometry("g", **kw)


def test_rank_outside_the_group_is_refused():
    planner = Planner([GroupGeometry("full", GroupKind.FULL_ATTENTION, 4, DcpGeometry(world_size=2))])
    with pytest.raises(ValueError, match=r"world_size=2, rank=2, interleave=1 is invalid"):
        planner.for_rank(2)


def test_plan_fills_the_engine_end_to_end(backend):
    """Planner entries drive the engine: W ranks reassembled == one rank."""
    import torch

    from kvfill.kernels import CacheGroup, FillEngine

    bs, W, I = 8, 2, 4
    tables = {1: [5, 2, 7, 1, 3, 6, 9, 4, 8], W: [3, 8, 1, 6, 2]}  # block 0 is the null block
    results = {}
    for world, table in tables.items():
        geo = GroupGeometry("full", GroupKind.FULL_ATTENTION, bs, DcpGeometry(world, 0, I if world > 1 else 1))
        planner = Planner([geo])
        sel = planner.select("a", 70, 3, [table])
        for rank in range(world):
            cache = torch.zeros(10, 1, bs, 4)
            rank_planner = planner.for_rank(rank)
            eng = FillEngine({"full": CacheGroup({"l": cache}, dcp=rank_planner.groups[0].dcp)},
                             mean=0.0, std=1.0, backend=backend)
            eng.fill(rank_planner.plan([sel]))
            results[(world, rank)] = cache
    for t in range(3, 69):
        ref = results[(1, 0)][tables[1][t // bs], 0, t % bs]
        off = t % (bs * W)
        rank = (off // I) % W
        local_off = (off // (W * I)) * I + off % I
        got = results[(W, rank)][tables[W][t // (bs * W)], 0, local_off]
        assert torch.equal(ref, got), t
        assert ref.abs().sum() > 0
    # The slots outside [3, 69) stay zero on every rank.
    filled = sum(int((c != 0).any(dim=(1, 3)).sum()) for c in results.values() if c is not results[(1, 0)])
    assert filled == 69 - 3


def test_plan_dedups_shared_blocks_and_remaps_multi_token_slots_as_the_connector_needs():
    """``Planner.plan`` is the worker's one call from a step's selections to the
    engine's plan: a block shared by two requests of the step is planned once,
    and a group whose caches hold 4 tokens per slot (16 slots per 64-token
    block, compressed MLA) gets its planned blocks whole, in slot units."""
    planner = Planner([
        GroupGeometry("full", GroupKind.FULL_ATTENTION, 16),
        GroupGeometry("mla", GroupKind.FULL_ATTENTION, 64, slots_per_block=16),
    ])
    assert not planner.groups[0].remaps_to_whole_blocks and planner.groups[1].remaps_to_whole_blocks
    x = planner.select("x", 40, 0, [[5, 6, 7], [3]])                   # tokens [0, 39)
    y = planner.select("y", 40, 0, [[5, 6, 7], [3]])                   # the same blocks (a shared prefix)
    z = planner.select("z", 140, 0, [list(range(10, 19)), [4, 9, 2]])  # tokens [0, 139)
    plan = planner.plan([x, y, z])

    def rows(g):
        return sorted(zip(g.block_ids.tolist(), g.slot_start.tolist(), g.slot_end.tolist(), g.local_base.tolist()))

    full = rows(plan["full"])
    assert full[:3] == [(5, 0, 16, 0), (6, 0, 16, 16), (7, 0, 7, 32)]  # x and y's blocks, once
    assert [b for b, *_ in full[3:]] == list(range(10, 19)) and full[-1] == (18, 0, 11, 128)
    # MLA: x/y's block 3 once and z's three blocks, each whole (16 slots);
    # block k of a table holds slots [16k, 16k + 16).
    assert rows(plan["mla"]) == [(2, 0, 16, 32), (3, 0, 16, 0), (4, 0, 16, 0), (9, 0, 16, 16)]
    # Only the groups asked for are planned (a worker passes its engine's groups).
    assert list(planner.plan([x, y, z], groups=["mla"]).groups) == ["mla"]
    other = Planner([planner.groups[0]]).select("q", 5, 0, [[1]])
    with pytest.raises(ValueError, match=r"request 'q' has block ids for 1 groups, the planner has 2"):
        planner.plan([x, other])


def test_each_entry_carries_its_requests_bank_sequence_and_a_shared_block_one_sequence():
    """Replay: every entry of a request names the request's bank sequence; a
    block two requests of a step share (even with other slot ranges) replays
    the first request's, so no slot gets two writers with different bytes."""
    planner = Planner([GroupGeometry("full", GroupKind.FULL_ATTENTION, 16)])
    x = planner.select("x", 40, 0, [[5, 6, 7]], sequence=3)           # tokens [0, 39): block 7 slots [0, 7)
    y = planner.select("y", 44, 0, [[5, 6, 7]], sequence=1)           # block 7 slots [0, 11)
    z = planner.select("z", 20, 0, [[8, 9]], sequence=2)
    g = planner.plan([x, y, z])["full"]
    seq = dict(zip(zip(g.block_ids.tolist(), g.slot_end.tolist()), g.sequence.tolist()))
    assert seq == {(5, 16): 3, (6, 16): 3, (7, 7): 3, (7, 11): 3, (8, 16): 2, (9, 3): 2}
    # without repeats the planner keeps request order and sequences untouched
    assert planner.plan([z])["full"].sequence.tolist() == [2, 2]


@pytest.mark.parametrize("world,interleave", [(1, 1), (2, 1), (2, 4), (4, 2)])
@pytest.mark.parametrize("recorded", [1, 3, 8, 21, 40])
def test_wrapped_positions_are_the_slots_each_rank_fills_from_a_row_of_another_position(world, interleave, recorded):
    """The scheduler counts wrapped positions by global position (t >= N);
    each DCP rank replays local slot l from its own rows, ``l mod L`` of the
    ``L`` it holds of the sequence (bank/parts.py, a rank holding none keeps
    I rows).  Over the ranks, the slots whose row was recorded at another
    position than the slot's are exactly the scheduler's count."""
    from kvfill.bank.parts import BankPart
    from kvfill.connector.geometry import GroupSelection
    from kvfill.connector.planner import wrapped_positions

    bs, lo, hi = 8, 5, 61
    geo = GroupGeometry("attn", GroupKind.FULL_ATTENTION, bs, DcpGeometry(world, 0, interleave))
    first, last = lo // geo.span, (hi - 1) // geo.span
    sel = GroupSelection(first, list(range(first, last + 1)), lo, hi, sequences=[0] * (last - first + 1))
    counted = wrapped_positions([geo], [sel], [recorded])
    moved = 0
    for rank in range(world):
        dcp = geo.dcp.on_rank(rank)
        rows, local = BankPart(dcp=dcp).rows([recorded])
        rows = list(range(recorded)) if rows is None else rows.tolist()  # recorded position of each local row
        for t in range(lo, hi):
            owner, l = (t // interleave) % world, (t // (interleave * world)) * interleave + t % interleave
            if owner == rank and rows[l % local[0]] != t:
                moved += 1
    assert counted == moved == max(0, hi - max(lo, recorded))
