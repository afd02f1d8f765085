"""KVFillConnector through vLLM's real Scheduler and the worker connector over
real CPU caches in vLLM's standard layout, in poisoned memory."""
import contextlib
from dataclasses import replace

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.cpu_only  # the harness runs vLLM's CPU build
from oracle import row_bits, write_expected  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm_harness import make_harness, runner_output  # noqa: E402

from kvfill.kernels import values as V  # noqa: E402

BS = 16
ATT = dict(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
FILL = {"fill_mean": 0.1, "fill_std": 0.5, "seed": 5}
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def expected_after(h, fills, *, mean=0.1, std=0.5, seed=5, mode=None, base=None):
    """``base`` (default: the poisoned buffer) with exactly ``fills`` applied by
    the oracle.  fills: [(layer name, block, slot, position)]"""
    expected = (h.poison if base is None else base).clone()
    views = h.views_over(expected)
    for name, block, slot, pos in fills:
        v = views[name]
        spec = h.specs[name]
        vdtype = V.value_dtype(v.dtype, "auto") if v.dtype != torch.uint8 else None
        bits = row_bits(
            mode=mode or (V.NORMAL if std > 0 else V.CONSTANT), mean=mean, std=std, seed=seed,
            layer=int(name.split(".")[2]), position=pos, row_size=v[0, :, 0].numel(),
            vdtype=vdtype, itemsize=v.element_size(),
        )
        write_expected(v, block_dim=0, slot_dim=2, kernel_split=1, block=block, slot=slot, bits=bits)
    return expected


def token_fills(h, req_id, lo, hi, group=0, layers=LAYERS, span=BS):
    table = h.block_table(req_id)[group]
    return [(name, table[t // span], t % span, t) for name in layers for t in range(lo, hi)]


def assert_attention_filled_and_second_group_zeroed(h, attn_layer, zero_layer, prompt_len):
    """One request of ``prompt_len`` tokens over a full-attention group and a
    group filled with zeros (circular buffer, Mamba state): the attention slots
    hold values, the second group's non-null blocks of the request are zeroed
    whole, and no other byte changes."""
    h.add("a", list(range(1, prompt_len + 1)))
    _, meta = h.step()
    full_ids, zero_ids = h.block_table("a")
    null = h.scheduler.kv_cache_manager.block_pool.null_block.block_id
    live = [b for b in zero_ids if b != null]
    assert live and meta.reqs_to_fill["a"][0][1] == live
    n_ext = prompt_len - 1
    expected = expected_after(h, [(attn_layer, full_ids[t // BS], t % BS, t) for t in range(n_ext)])
    zero_view = h.views_over(expected)[zero_layer]
    for b in live:
        zero_view[b].view(torch.uint8).zero_()
    assert_bytes(h.raw, expected)


def assert_bytes(actual, expected):
    diff = (actual != expected).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at {diff[:6].tolist()}"


@pytest.fixture
def full(tmp_path):
    return make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prompt_minus_last_token_is_filled_and_nothing_else(tmp_path, backend):
    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra={**FILL, "backend": backend})
    assert h.worker.worker.engine.backend == backend
    h.add("a", list(range(1, 41)))
    out, meta = h.step()
    assert out.num_scheduled_tokens["a"] == 1  # only the last prompt token is computed
    assert out.has_sync_kv_loads  # so the model runner fills before the forward
    assert meta.reqs_to_fill["a"][1] == 39
    assert_bytes(h.raw, expected_after(h, token_fills(h, "a", 0, 39)))


def test_no_refill_on_later_steps(full):
    h = full
    h.add("a", list(range(1, 41)))
    h.step()
    after_first = h.raw.clone()
    _, meta = h.step()
    assert meta.reqs_to_fill == {}
    assert torch.equal(h.raw, after_first)


def test_concurrent_requests_fill_in_one_step(full):
    h = full
    h.add("a", list(range(1, 41)))
    h.add("b", list(range(100, 133)))
    _, meta = h.step()
    assert set(meta.reqs_to_fill) == {"a", "b"}
    assert_bytes(h.raw, expected_after(h, token_fills(h, "a", 0, 39) + token_fills(h, "b", 0, 32)))


@pytest.mark.parametrize("n", [1, 2])
def test_one_and_two_token_prompts(full, n):
    h = full
    h.add("a", list(range(1, 1 + n)))
    out, meta = h.step()
    assert out.num_scheduled_tokens["a"] == 1
    assert_bytes(h.raw, expected_after(h, token_fills(h, "a", 0, n - 1)))
    assert ("a" in meta.reqs_to_fill) == (n == 2)


def test_prefix_cache_hit_fills_only_the_suffix(full):
    h = full
    prompt = list(range(1, 41))
    h.add("a", prompt, max_tokens=1)
    _, meta_a = h.step()  # a: tokens [0, 39) filled, then finishes (1 output token)
    shared = meta_a.reqs_to_fill["a"][0][0][:2]
    before = h.raw.clone()
    h.add("b", prompt[:32] + [900 + i for i in range(20)])  # 2 full blocks shared with a
    _, meta = h.step()
    table = h.block_table("b")[0]
    assert table[:2] == shared
    assert meta.reqs_to_fill["b"][1] == 51 - 32
    fills = [(name, table[t // BS], t % BS, t) for name in LAYERS for t in range(32, 51)]
    # The oracle writes the suffix into the bytes as they were before b:
    # the shared prefix blocks keep a's bytes.
    expected = expected_after(h, fills, base=before)
    assert_bytes(h.raw, expected)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hybrid_groups_each_get_their_own_blocks_and_null_padding_is_skipped(tmp_path, backend):
    sw = ["model.layers.1.self_attn.attn"]
    full_layers = ["model.layers.0.self_attn.attn"]
    h = make_harness(
        tmp_path,
        [(full_layers, FullAttentionSpec(**ATT)), (sw, SlidingWindowSpec(**ATT, sliding_window=32))],
        extra={**FILL, "backend": backend},
        layout="BLNHC",
    )
    h.add("a", list(range(1, 101)))
    _, meta = h.step()
    full_ids, sw_ids = h.block_table("a")
    groups, n_ext = meta.reqs_to_fill["a"]
    assert n_ext == 99
    assert groups[0] == full_ids[:7]
    null = h.scheduler.kv_cache_manager.block_pool.null_block.block_id
    assert groups[1] == [b for b in sw_ids[:7] if b != null]
    fills = [(full_layers[0], full_ids[t // BS], t % BS, t) for t in range(99)]
    fills += [(sw[0], sw_ids[t // BS], t % BS, t) for t in range(99) if sw_ids[t // BS] != null]
    assert_bytes(h.raw, expected_after(h, fills))


def test_preempted_request_is_filled_again_not_prefilled(full):
    h = full
    req = h.add("a", list(range(1, 41)), max_tokens=8)
    h.step()
    h.step()
    # Preempt as the scheduler does under memory pressure.
    h.scheduler.running.remove(req)
    h.scheduler._preempt_request(req, 0.0)
    assert req.num_computed_tokens == 0 and req.num_preemptions == 1
    before = h.raw.clone()
    out, meta = h.step()
    assert "a" in meta.reqs_to_fill
    # Prompt (40) + 2 tokens sampled before the preemption = 42; the two full
    # blocks freed by the preemption are prefix-cache hits (32 tokens), the
    # rest but the last token is filled again.
    assert meta.reqs_to_fill["a"][1] == 42 - 32 - 1
    assert out.num_scheduled_tokens["a"] == 1  # not a real re-prefill
    expected = expected_after(h, token_fills(h, "a", 32, 41), base=before)
    assert_bytes(h.raw, expected)


def test_preempted_request_is_prefilled_when_refill_is_off(tmp_path):
    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra={**FILL, "refill_on_preemption": False})
    req = h.add("a", list(range(1, 41)), max_tokens=8)
    h.step()
    h.scheduler.running.remove(req)
    h.scheduler._preempt_request(req, 0.0)
    out, meta = h.step()
    assert "a" not in meta.reqs_to_fill and out.num_scheduled_tokens["a"] > 1


@pytest.mark.parametrize("seeds,same", [((5, 5), True), ((5, 6), False)])
def test_seed_determinism(tmp_path, seeds, same):
    raws = []
    for i, seed in enumerate(seeds):
        h = make_harness(tmp_path / str(i), [(LAYERS, FullAttentionSpec(**ATT))], extra={**FILL, "seed": seed})
        h.add("a", list(range(1, 41)))
        h.step()
        raws.append(h.raw)
    assert torch.equal(raws[0], raws[1]) == same


def test_unknown_config_key_is_refused_listing_valid_keys(tmp_path):
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key\(s\) \['fill_sdt'\]; valid keys: \[.*'fill_std'"):
        make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra={"fill_sdt": 0.1})


@pytest.mark.parametrize(
    "dtype,kv_quant,cache_dtype,fp8",
    [
        (torch.uint8, "FP8_PER_TENSOR", "fp8", torch.float8_e4m3fn),
        (torch.uint8, "FP8_PER_TENSOR", "fp8_e5m2", torch.float8_e5m2),
        (torch.float8_e4m3fn, None, "fp8", torch.float8_e4m3fn),
        (torch.uint8, None, "nvfp4", None),  # packed: zeroed
    ],
)
def test_fp8_caches_are_encoded_and_packed_ones_zeroed(tmp_path, dtype, kv_quant, cache_dtype, fp8):
    from vllm.v1.kv_cache_interface import KVQuantMode

    kw = {"kv_quant_mode": getattr(KVQuantMode, kv_quant)} if kv_quant else {}
    spec = FullAttentionSpec(**{**ATT, "dtype": dtype}, **kw)
    h = make_harness(tmp_path, [(LAYERS, spec)], extra=FILL, cache_dtype=cache_dtype)
    expected_enc = "packed" if fp8 is None else ("native" if dtype != torch.uint8 else
                                                 ("fp8_e5m2" if fp8 == torch.float8_e5m2 else "fp8_e4m3"))
    assert all(h.worker.worker.facts.encodings[n] == expected_enc for n in LAYERS)
    h.add("a", list(range(1, 41)))
    h.step()
    table = h.block_table("a")[0]
    for name in LAYERS:
        v = h.views[name]
        for t in range(39):
            got = v[table[t // BS], :, t % BS].contiguous().view(torch.uint8)
            if fp8 is None:
                assert (got == 0).all()
            else:
                want = row_bits(mode=V.NORMAL, mean=0.1, std=0.5, seed=5, layer=int(name.split(".")[2]),
                                position=t, row_size=v[0, :, 0].numel(), vdtype=fp8, itemsize=1)
                assert torch.equal(got.flatten(), want.view(torch.uint8))
    # Slot 39 (the last prompt token) and other blocks keep their poison.
    assert torch.equal(h.views[LAYERS[0]][table[2], :, 39 % BS].contiguous().view(torch.uint8),
                       h.views_over(h.poison)[LAYERS[0]][table[2], :, 39 % BS].contiguous().view(torch.uint8))


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC"])  # contiguous / strided per-layer views
def test_startup_fill_fills_whole_caches_then_no_per_request_fills(tmp_path, layout):
    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra={**FILL, "startup_fill": True},
                     layout=layout)
    for name in LAYERS:
        v = h.views[name]
        nb = v.shape[0]
        rows = v.permute(0, 2, 1, 3).reshape(nb * BS, -1)
        for b in (0, 17, nb - 1):
            for s in (0, BS - 1):
                want = row_bits(mode=V.NORMAL, mean=0.1, std=0.5, seed=5, layer=int(name.split(".")[2]),
                                position=b * BS + s, row_size=rows.shape[1], vdtype=torch.bfloat16, itemsize=2)
                assert torch.equal(rows[b * BS + s].view(torch.int16), want)
    before = h.raw.clone()
    h.add("a", list(range(1, 41)))
    _, meta = h.step()
    assert all(not ids for ids in meta.reqs_to_fill.get("a", ((),))[0])
    assert torch.equal(h.raw, before)


def test_loading_by_module_path_and_by_plugin_name(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    from kvfill.connector import KVFillConnector
    from vllm_harness import model_dir, vllm_config

    by_path = vllm_config(model_dir(tmp_path), module_path="kvfill.connector")
    assert KVConnectorFactory.get_connector_class(by_path.kv_transfer_config) is KVFillConnector
    load_general_plugins()  # the vllm.general_plugins entry point registers the name
    by_name = vllm_config(model_dir(tmp_path), module_path=None)
    assert KVConnectorFactory.get_connector_class(by_name.kv_transfer_config) is KVFillConnector


def test_circular_buffer_group_is_zeroed_whole(tmp_path):
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    ring = ["model.layers.1.self_attn.attn"]
    full_layers = ["model.layers.0.self_attn.attn"]
    h = make_harness(
        tmp_path,
        [(full_layers, FullAttentionSpec(**ATT)), (ring, CircularBufferSpec(**ATT))],
        extra=FILL,
        layout="BLNHC",
    )
    assert_attention_filled_and_second_group_zeroed(h, full_layers[0], ring[0], 100)


def test_dcp_spans_per_group_and_rank_local_slots(tmp_path):
    """DCP = 2: full attention spans 32 tokens a block, a sliding-window group
    vLLM does not shard (``dcp_sharded=False``, what newer vLLM's per-spec
    helper says of every sliding window) 16 - the per-group span of vLLM PR
    54679; each rank writes the tokens it owns."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from kvfill.connector.options import FillOptions
    from kvfill.connector.scheduler import KVFillScheduler
    from kvfill.connector.worker import KVFillWorker

    sw = ["model.layers.1.self_attn.attn"]
    full_layers = ["model.layers.0.self_attn.attn"]
    h = make_harness(tmp_path, [(full_layers, FullAttentionSpec(**ATT)),
                                (sw, SlidingWindowSpec(**ATT, sliding_window=4096, dcp_sharded=False))],
                   extra=FILL, layout="BLNHC")
    par = SimpleNamespace(decode_context_parallel_size=2, tensor_parallel_size=2, prefill_context_parallel_size=1,
                          cp_kv_cache_interleave_size=1)
    cfg_ns = SimpleNamespace(parallel_config=par, cache_config=h.config.cache_config)
    cfg = FillOptions.from_extra_config(FILL)
    sched = KVFillScheduler(cfg_ns, h.kv_cache_config, cfg)
    req = SimpleNamespace(request_id="r", num_tokens=34, num_preemptions=0)
    blocks = KVCacheBlocks(([KVCacheBlock(i) for i in (1, 2, 3)], [KVCacheBlock(i) for i in (5, 6, 7, 8)]))
    assert sched.get_num_new_matched_tokens(req, 0) == (33, False)
    sched.update_state_after_alloc(req, blocks, 33)
    meta = sched.build_connector_meta(None)
    assert meta.reqs_to_fill["r"] == (([1, 2], [5, 6, 7]), 33)

    for rank in (0, 1):
        worker = KVFillWorker(cfg_ns, h.kv_cache_config, cfg, dcp_rank=rank, tp_rank=rank)
        raw = h.poison.clone()
        views = h.views_over(raw)
        worker.register_kv_caches(views)
        worker.start_fill(meta)
        expected = h.poison.clone()
        fills = []
        for t in range(33):
            owner, local = (t % 2), (t // 32) * 16 + (t % 32) // 2
            if owner == rank:
                fills.append((full_layers[0], [1, 2][t // 32], local % BS, t))
            fills.append((sw[0], [5, 6, 7][t // BS], t % BS, t))  # W = 1: every rank holds every token
        expected = expected_after(h, fills, base=expected)
        assert_bytes(raw, expected)


def test_in_tree_metadata_alone_fills_whole_blocks(full):
    from kvfill.connector import KVFillConnectorMetadata

    h = full
    meta = KVFillConnectorMetadata(reqs_to_fill={"x": (([4, 9],), 20)})
    h.worker.bind_connector_metadata(meta)
    h.worker.start_load_kv(None)
    fills = [(name, b, s, k * BS + s) for name in LAYERS for k, b in enumerate([4, 9]) for s in range(BS)]
    assert_bytes(h.raw, expected_after(h, fills))


def test_finished_requests_are_forgotten_and_stats_are_reported(full):
    h = full
    h.add("a", list(range(1, 41)), max_tokens=1)
    h.step()
    conn = h.scheduler.connector
    assert "a" not in conn.scheduler.filled  # request_finished(_all_groups) cleaned up
    stats = h.worker.get_kv_connector_stats()
    assert stats is not None and stats.data["requests"] == 1 and stats.data["bytes"] == 2 * 39 * 32 * 2
    assert stats.reduce()["kvfill_fills"] == 1
    assert h.worker.get_kv_connector_stats() is None  # reset after reporting
    assert type(h.worker).build_kv_connector_stats(stats.data).data == stats.data


def test_re_registration_rebuilds_the_engine(full):
    h = full
    first = h.worker.worker.engine
    h.worker.register_kv_caches(h.views)
    assert h.worker.worker.engine is not first
    h.add("a", list(range(1, 41)))
    h.step()
    assert_bytes(h.raw, expected_after(h, token_fills(h, "a", 0, 39)))


def test_a_block_shared_by_two_requests_of_a_step_is_filled_once(full):
    """Two selections naming the same block and tokens: one entry reaches the engine."""
    from kvfill.connector import KVFillConnectorMetadata

    h = full
    sched = h.scheduler.connector.scheduler
    sel = sched.planner.select("x", 40, 0, [[5, 6, 7]])
    twin = sched.planner.select("y", 40, 0, [[5, 6, 7]])
    h.worker.bind_connector_metadata(KVFillConnectorMetadata(selections={"x": sel, "y": twin}))
    h.worker.start_load_kv(None)
    assert h.worker.worker.last_stats.entries == 3
    assert_bytes(h.raw, expected_after(h, [(n, [5, 6, 7][t // BS], t % BS, t) for n in LAYERS for t in range(39)]))


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_request_streams_fill_exactly_their_external_slots(tmp_path_factory, data):
    """Random prompts sharing random prefixes, arriving over several steps:
    after every step the caches equal the oracle's writes of every fill so far
    (external slots only, each request in its own blocks; nothing else)."""
    h = make_harness(tmp_path_factory.mktemp("fuzz"), [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)
    base = list(range(1, 200))
    reqs = data.draw(st.lists(
        st.tuples(st.integers(0, 80), st.integers(1, 60), st.integers(1, 3), st.integers(0, 2)),
        min_size=1, max_size=5))
    expected = h.poison.clone()
    pending = list(enumerate(reqs))
    for step in range(12):
        for i, (shared, own, max_tokens, arrive) in list(pending):
            if arrive <= step:
                h.add(f"r{i}", base[:shared] + [500 + 7 * i + j for j in range(own)], max_tokens=max_tokens)
                pending.remove((i, (shared, own, max_tokens, arrive)))
        if not pending and not h.scheduler.running and not h.scheduler.waiting:
            break
        out = h.scheduler.schedule()
        meta = out.kv_connector_metadata
        fills = []
        for rid, (groups, n_ext) in meta.reqs_to_fill.items():
            req = h.scheduler.requests[rid]
            n_tok = req.num_tokens
            local = n_tok - 1 - n_ext
            assert 0 <= local and local % BS == 0, (rid, n_tok, n_ext)  # prefix hits are whole blocks
            table = h.block_table(rid)[0]
            fills += [(n, table[t // BS], t % BS, t) for n in LAYERS for t in range(local, n_tok - 1)]
        h.worker.bind_connector_metadata(meta)
        h.worker.start_load_kv(None)
        h.worker.clear_connector_metadata()
        expected = expected_after(h, fills, base=expected)
        assert_bytes(h.raw, expected)
        ids = list(out.num_scheduled_tokens)
        h.scheduler.update_from_output(out, runner_output(ids))


def test_mamba_group_state_rows_are_zeroed_beside_attention(tmp_path):
    """vLLM 0.32 registers a Mamba layer as one raw byte view per block
    ([num_blocks, 1, 1, page_bytes], several state dtypes packed): the request's
    non-null state rows are zeroed, attention gets values, nothing else changes."""
    from vllm.v1.kv_cache_interface import MambaSpec

    page = FullAttentionSpec(**ATT).page_size_bytes
    mamba = MambaSpec(block_size=BS, shapes=((4, 8), (2, 4)), dtypes=(torch.float32, torch.bfloat16),
                      page_size_padded=page)
    attn, mixer = ["model.layers.0.self_attn.attn"], ["model.layers.1.mixer"]
    # mamba_cache_mode "none" is vLLM's mode without prefix caching (vLLM 0.34 asserts they never meet)
    h = make_harness(tmp_path, [(attn, FullAttentionSpec(**ATT)), (mixer, mamba)], extra=FILL, layout="BLHNC",
                     prefix_caching=False)
    assert h.views[mixer[0]].shape[1:3] == (1, 1)
    assert_attention_filled_and_second_group_zeroed(h, attn[0], mixer[0], 40)


def test_caches_with_several_tokens_per_slot_get_whole_blocks(tmp_path):
    """Compressed MLA (tokens_per_state = 4): a 64-token block has 16 state
    slots; the planned blocks are filled whole instead of being skipped."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=64, dtype=torch.bfloat16, tokens_per_state=4)
    name = "model.layers.0.self_attn.attn"
    h = make_harness(tmp_path, [([name], spec)], extra=FILL, block_size=64)
    assert h.views[name].shape[2] == 16
    geo = h.worker.worker.registration.planner.groups[0]
    assert (geo.block_size, geo.slots_per_block, geo.remaps_to_whole_blocks) == (64, 16, True)
    h.add("a", list(range(1, 301)))
    _, meta = h.step()
    table = h.block_table("a")[0][: -(-299 // 64)]
    assert meta.reqs_to_fill["a"] == ([table], 299) or meta.reqs_to_fill["a"] == ((table,), 299)
    fills = [(name, b, s, k * 16 + s) for k, b in enumerate(table) for s in range(16)]
    assert_bytes(h.raw, expected_after(h, fills))


def test_a_grant_trimmed_by_the_scheduler_starts_at_the_local_prefix(full):
    """vLLM may trim the external grant's end (DSV4 bounded replay keeps whole
    blocks): the fill covers [local, local + granted), not the prompt's tail."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    sched = full.scheduler.connector.scheduler
    req = SimpleNamespace(request_id="t", num_tokens=100, num_preemptions=0)
    assert sched.get_num_new_matched_tokens(req, 32) == (67, False)
    blocks = KVCacheBlocks(([KVCacheBlock(i) for i in range(1, 8)],))
    sched.update_state_after_alloc(req, blocks, 64)  # trimmed to whole blocks
    sel = sched.build_connector_meta(None).selections["t"].groups[0]
    assert (sel.token_lo, sel.token_hi, sel.first_block) == (32, 96, 2)
    assert list(sel.block_ids) == [3, 4, 5, 6]


def test_layers_without_block_views_are_skipped_not_fatal(full, monkeypatch):
    """Specs whose layers lay out a raw buffer themselves (has_layer_views is
    False, e.g. HiSparse) cannot be addressed by block: skipped with a warning."""
    h = full
    name0, name1 = LAYERS
    facts = h.worker.worker.facts
    h.worker.worker.facts = replace(facts, unaddressable=facts.unaddressable | {name1})
    raw_views = dict(h.views)
    raw_views[name1] = h.raw[:4096]  # a 1-D raw buffer, as such layers register
    h.worker.register_kv_caches(raw_views)
    h.add("a", list(range(1, 41)))
    h.step()
    assert_bytes(h.raw, expected_after(h, token_fills(h, "a", 0, 39, layers=[name0])))


def test_a_group_vllm_keeps_out_of_kv_transfer_is_neither_loaded_nor_filled(tmp_path):
    """vLLM 0.34 marks HiSparse's hot and resident tiers ``enable_kv_transfer``
    False (replicas it rebuilds from their source after a load): kvfill loads
    and fills the other group's tokens and nothing else, and leaves the tier
    out of the startup fill."""
    from kvfill.connector.specs import startup_fill_group_ids

    tier = ["model.layers.2.self_attn.attn", "model.layers.3.self_attn.attn"]
    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT)), (tier, FullAttentionSpec(**ATT))], extra=FILL,
                     untransferred=(1,))
    assert startup_fill_group_ids(h.kv_cache_config) == {0} and list(h.worker.worker.engine.groups) == ["group0"]
    req = h.add("a", list(range(1, 41)))
    assert h.worker.get_loaded_kv_cache_group_ids(req) == (0,)
    h.step()
    assert h.block_table("a")[1]  # the tier has blocks of its own, left as they were
    assert_bytes(h.raw, expected_after(h, token_fills(h, "a", 0, 39)))


def test_the_worker_fills_exactly_what_planner_plan_returns(full, monkeypatch):
    """The shipped path: start_fill hands the engine the very FillPlan that
    Planner.plan builds from the step's selections (nothing reshaped after)."""
    from kvfill.connector.planner import Planner
    from kvfill.kernels import FillEngine

    planned, filled = [], []
    real_plan, real_fill = Planner.plan, FillEngine.fill
    monkeypatch.setattr(Planner, "plan", lambda self, *a, **k: planned.append(real_plan(self, *a, **k)) or planned[-1])
    monkeypatch.setattr(FillEngine, "fill", lambda self, plan: filled.append(plan) or real_fill(self, plan))
    h = full
    h.add("a", list(range(1, 41)))
    h.step()
    assert len(planned) == 1 and filled == planned
    assert planned[0]["group0"].num_slots == 39
    assert_bytes(h.raw, expected_after(h, token_fills(h, "a", 0, 39)))


def test_dcp_with_a_chunked_local_group_plans_vllms_own_span(tmp_path, monkeypatch):
    """DCP 2, full attention + chunked local (64 tokens), prefix caching off:
    vLLM 0.32 shards chunked local too (``dcp_sharded``), so its blocks span
    16 x 2 tokens.  A real KVCacheManager allocates the tables; the scheduler
    side must select within them instead of raising out of ``schedule()``."""
    from types import SimpleNamespace

    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec
    from vllm.v1.request import Request

    from kvfill.connector.options import FillOptions
    from kvfill.connector.scheduler import KVFillScheduler

    monkeypatch.setenv("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE", "1")
    chunked = ChunkedLocalAttentionSpec(**ATT, attention_chunk_size=64)
    h = make_harness(tmp_path, [(["model.layers.0.self_attn.attn"], FullAttentionSpec(**ATT)),
                                (["model.layers.1.self_attn.attn"], chunked)], extra=FILL, prefix_caching=False)
    manager = KVCacheManager(h.kv_cache_config, max_model_len=2048, scheduler_block_size=BS, hash_block_size=BS,
                             enable_caching=False, dcp_world_size=2)
    req = Request("r", list(range(1, 101)), SamplingParams(max_tokens=4), None)
    assert manager.allocate_slots(req, 1, num_external_computed_tokens=99) is not None
    tables = manager.get_block_ids(req.request_id)
    span = resolve_dcp_kv_block_size(chunked, 2)
    assert span == 32 and len(tables[1]) == -(-100 // span) == 4  # vLLM's own table: 4 blocks

    par = SimpleNamespace(decode_context_parallel_size=2, tensor_parallel_size=2, prefill_context_parallel_size=1,
                          cp_kv_cache_interleave_size=1)
    sched = KVFillScheduler(SimpleNamespace(parallel_config=par), h.kv_cache_config, FillOptions.from_extra_config(FILL))
    assert [g.span for g in sched.planner.groups] == [32, 32]
    assert sched.get_num_new_matched_tokens(req, 0) == (99, False)
    sched.update_state_after_alloc(req, manager.get_blocks(req.request_id), 99)
    sel = sched.build_connector_meta(None).selections["r"]
    assert [list(g.block_ids) for g in sel.groups] == [tables[0][:4], tables[1][:4]]
    assert [(g.token_lo, g.token_hi) for g in sel.groups] == [(0, 99), (0, 99)]


def test_startup_filled_groups_are_skipped_before_planning(tmp_path):
    """startup_fill: a Mamba group (filled at registration) whose table is
    shorter than the prompt's blocks must not make update_state_after_alloc
    raise: its selection is skipped before it is planned, as the in-tree
    connector does.  17 external tokens of an 18-token request need two
    16-token blocks; the Mamba group holds one state block."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.kv_cache_interface import MambaSpec

    page = FullAttentionSpec(**ATT).page_size_bytes
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,), page_size_padded=page)
    h = make_harness(tmp_path, [(["model.layers.0.self_attn.attn"], FullAttentionSpec(**ATT)),
                                (["model.layers.1.mixer"], mamba)],
                     extra={**FILL, "startup_fill": True}, layout="BLHNC", prefix_caching=False)  # mode "none"
    sched = h.scheduler.connector.scheduler
    assert 1 in sched.startup_groups
    req = SimpleNamespace(request_id="m", num_tokens=18, num_preemptions=0)
    assert sched.get_num_new_matched_tokens(req, 0) == (17, False)
    blocks = KVCacheBlocks(([KVCacheBlock(3), KVCacheBlock(4)], [KVCacheBlock(9)]))
    sched.update_state_after_alloc(req, blocks, 17)
    sel = sched.build_connector_meta(None).selections["m"]
    assert [list(g.block_ids) for g in sel.groups] == [[3, 4], []]
    # And through vLLM's Scheduler: the step schedules only the last token.
    h.add("a", list(range(1, 19)))
    out, meta = h.step()
    assert out.num_scheduled_tokens["a"] == 1 and meta.reqs_to_fill["a"][0][1] == []


def test_a_request_asking_for_real_prefill_is_prefilled_by_vllm_beside_a_filled_one(tmp_path):
    """kv_transfer_params {"kvfill_prefill": true}: vLLM schedules the whole
    prompt and the connector plans nothing for it; its neighbour without
    the key (or with it false) is filled as ever."""
    h = make_harness(tmp_path, [(["model.layers.0.self_attn.attn"], FullAttentionSpec(**ATT))], extra=FILL,
                     layout="BLHNC", prefix_caching=False)
    h.add("real", list(range(1, 19)), kv_transfer_params={"kvfill_prefill": True})
    h.add("filled", list(range(21, 39)), kv_transfer_params={"kvfill_prefill": False})
    h.add("plain", list(range(41, 59)))
    out, meta = h.step()
    assert out.num_scheduled_tokens == {"real": 18, "filled": 1, "plain": 1}
    assert set(meta.reqs_to_fill) == {"filled", "plain"}


@pytest.mark.parametrize("prompt,shared", [([5], False), (list(range(1, 33)) + [99], True)],
                         ids=["one-token-prompt", "full-local-prefix-hit"])
def test_without_refill_a_request_with_nothing_to_fill_is_not_filled_after_preemption(tmp_path, prompt, shared):
    """refill_on_preemption false: a request the connector had nothing to fill
    for (a 1-token prompt; a prompt whose prefix is all locally cached) is
    still handled; once preempted, its generated history is recomputed, not
    offered as external KV (vLLM #57419 on the in-tree connector)."""
    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra={**FILL, "refill_on_preemption": False})
    if shared:
        h.add("warm", prompt, max_tokens=1)
        h.step()  # "warm" fills [0, 32) and finishes: its two full blocks are cached
    req = h.add("a", prompt, max_tokens=8)
    out, meta = h.step()
    assert "a" not in meta.reqs_to_fill  # nothing external: a full hit / one token
    for _ in range(3):
        h.step()
    h.scheduler.running.remove(req)
    h.scheduler._preempt_request(req, 0.0)
    out, meta = h.step()
    assert "a" not in meta.reqs_to_fill
    assert out.num_scheduled_tokens["a"] > 1  # recomputed for real


def test_a_preempted_request_keeps_its_in_flight_output(tmp_path):
    """kvfill hands no KV off: requires_kv_delivery is False, so when vLLM's
    scheduler preempts under memory pressure it does not drop in-flight
    output (the base class says True for kv_both)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL, num_blocks=8)
    assert KVConnectorBase_V1.requires_kv_delivery.fget(h.scheduler.connector) is True  # the default
    assert h.scheduler.requires_kv_delivery is False  # what vLLM's scheduler took from kvfill
    reqs = [h.add(r, list(range(1 + 100 * i, 48 + 100 * i)), max_tokens=40) for i, r in enumerate("ab")]
    for _ in range(40):
        h.step()
        if any(r.num_preemptions for r in reqs):
            break
    preempted = [r for r in reqs if r.num_preemptions]
    assert preempted, "no preemption under a 7-block cache"
    assert all(not r.drop_stale_output for r in preempted)


def test_every_group_is_reported_loaded_so_vllm_keeps_replay_windows(tmp_path):
    """kvfill fills each group of the request's own blocks, circular buffers
    included: vLLM's scheduler asks whether a load restores its bounded-replay
    groups, and with kvfill's answer it does (the default names only the
    prefix-cacheable groups)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.kv_cache_interface import CircularBufferSpec

    h = make_harness(tmp_path, [(["model.layers.0.self_attn.attn"], FullAttentionSpec(**ATT)),
                                (["model.layers.1.self_attn.attn"], CircularBufferSpec(**ATT))],
                     extra=FILL, layout="BLNHC")
    req = h.add("a", list(range(1, 41)))
    conn = h.scheduler.connector
    assert conn.get_loaded_kv_cache_group_ids(req) == (0, 1)
    assert 1 not in KVConnectorBase_V1.get_loaded_kv_cache_group_ids(conn, req)
    h.scheduler.prefix_replay_group_ids = (1,)  # as vLLM sets it for a bounded-replay group
    assert h.scheduler._load_restores_replay_window(req)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_skipped_fill_is_reported_and_vllm_applies_its_failure_policy(tmp_path, monkeypatch, policy):
    """A step whose fill is skipped reports its blocks as load errors; vLLM
    then recomputes the request (``recompute``) or fails it (``fail``) instead
    of decoding over poisoned memory."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from kvfill.kernels import FillEngine

    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)
    h.config.kv_transfer_config.kv_load_failure_policy = policy
    h.scheduler.recompute_kv_load_failures = policy == "recompute"  # what vLLM reads at construction
    before = h.raw.clone()
    req = h.add("a", list(range(1, 41)))
    out = h.scheduler.schedule()
    assert out.num_scheduled_tokens["a"] == 1

    def does_not_fit(self, plan):
        raise ValueError("block 9999 is past the caches")

    monkeypatch.setattr(FillEngine, "fill", does_not_fit)
    h.worker.bind_connector_metadata(out.kv_connector_metadata)
    h.worker.start_load_kv(None)
    h.worker.clear_connector_metadata()
    failed = h.worker.get_block_ids_with_load_errors()
    assert failed == set(h.block_table("a")[0][:3]) and h.worker.get_block_ids_with_load_errors() == set()
    assert torch.equal(h.raw, before)
    runner_out = runner_output(["a"], kv_connector_output=KVConnectorOutput(invalid_block_ids=failed))
    h.scheduler.update_from_output(out, runner_out)
    if policy == "recompute":
        assert req.num_computed_tokens < 39
        assert h.scheduler.schedule().num_scheduled_tokens["a"] > 1  # the prompt is computed for real
    else:
        assert req.status == RequestStatus.FINISHED_ERROR


def test_fill_figures_reach_vllms_prometheus_metrics(full):
    """build_prom_metrics: kvfill's bytes, seconds, requests and fills become
    counters in vLLM's Prometheus registry (the served /metrics)."""
    h = full
    h.add("a", list(range(1, 41)))
    h.step()
    stats = h.worker.get_kv_connector_stats()
    with observed(h.config, stats.data) as value:
        assert value("vllm:kvfill_bytes_total") == 2 * 39 * 32 * 2
        assert value("vllm:kvfill_requests_total") == 1 and value("vllm:kvfill_fills_total") == 1
        assert value("vllm:kvfill_seconds_total") > 0


@contextlib.contextmanager
def observed(config, data: dict):
    """``data`` (a connector's stats) observed by vLLM's Prometheus metrics
    as the engine's logger does; yields ``name -> value``, the metrics made
    unregistered after."""
    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    before = set(prometheus_client.REGISTRY._names_to_collectors)
    prom = KVConnectorProm(config, ["engine"], {0: ["0"]})
    try:
        prom.observe(data, 0)
        yield lambda name: prometheus_client.REGISTRY.get_sample_value(name, {"engine": "0"})
    finally:
        for name, collector in list(prometheus_client.REGISTRY._names_to_collectors.items()):
            if name not in before:
                with contextlib.suppress(KeyError):
                    prometheus_client.REGISTRY.unregister(collector)


def test_verified_fills_and_mismatches_are_counted(tmp_path, monkeypatch):
    """verify: "log" counts every re-checked fill and the elements found wrong,
    so a soak can tell that verification ran and found nothing."""
    from kvfill.kernels.torch_fill import TorchBackend

    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra={**FILL, "verify": "log"})
    h.add("a", list(range(1, 41)))
    h.step()
    monkeypatch.setattr(TorchBackend, "fill", lambda self, plan: 0)  # a broken backend: writes nothing
    h.add("b", list(range(100, 140)))
    h.step()
    data = h.worker.get_kv_connector_stats().data
    assert data["verified"] == 2 and data["mismatched"] == 2 * 39 * 32  # b's rows, both layers
    assert h.worker.get_kv_connector_stats() is None


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_skipped_fill_with_several_groups_follows_the_policy_without_crashing_vllm(tmp_path, monkeypatch, policy):
    """vLLM 0.32 raises on block-level load failures when a model has several
    KV cache groups (block ids are per group): kvfill does not report them
    there; under "fail" it fails loudly itself, under "recompute" it logs."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvfill.kernels import FillEngine

    h = make_harness(tmp_path, [(["model.layers.0.self_attn.attn"], FullAttentionSpec(**ATT)),
                                (["model.layers.1.self_attn.attn"], SlidingWindowSpec(**ATT, sliding_window=32))],
                     extra=FILL, layout="BLNHC")
    h.worker.worker.load_failure_policy = policy  # what the worker read from kv_transfer_config
    h.add("a", list(range(1, 41)))
    out = h.scheduler.schedule()
    monkeypatch.setattr(FillEngine, "fill", lambda self, plan: (_ for _ in ()).throw(ValueError("block 9999")))
    h.worker.bind_connector_metadata(out.kv_connector_metadata)
    if policy == "fail":
        with pytest.raises(RuntimeError, match=r"2 KV cache groups.*kv_load_failure_policy 'fail'"):
            h.worker.start_load_kv(None)
        return
    h.worker.start_load_kv(None)
    assert h.worker.get_block_ids_with_load_errors() == set()
    h.scheduler.update_from_output(out, runner_output(
        ["a"], kv_connector_output=KVConnectorOutput(invalid_block_ids=h.worker.get_block_ids_with_load_errors())))


# ------------------------------------------------------------------ replay: which sequence a block takes
def replay_scheduler(tmp_path, recorded):
    """A replay scheduler over a bank recording ``recorded`` (token lists)."""
    from kvfill.connector.options import FillOptions
    from kvfill.connector.scheduler import KVFillScheduler
    from kvfill.kernels import Bank

    path = tmp_path / "bank.safetensors"
    Bank({LAYERS[0]: torch.zeros(sum(map(len, recorded)), 32, dtype=torch.bfloat16, device="cpu")},
         sequence_lengths=[len(t) for t in recorded], sequence_tokens=recorded).save(path)
    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))])
    return KVFillScheduler(h.config, h.kv_cache_config, FillOptions.from_extra_config({"bank": str(path)}))


def blocks_of(*ids):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def test_a_refill_after_preemption_chooses_by_the_tokens_it_refills_not_the_prompts(tmp_path):
    """Preempted after generating 20 tokens, a request is refilled past its
    prompt: the block beyond the prompt replays the recorded sequence that
    continues with exactly those generated tokens."""
    from types import SimpleNamespace

    from kvfill.kernels import BankIndex

    prompt = list(range(100, 120))                 # 20 tokens: blocks 0 and 1 (16 + 4)
    generated = list(range(500, 520))              # 20 more: the request holds 40
    recorded = [prompt + [9 + k] * 20 for k in range(8)]  # other continuations...
    # chosen by the prompt alone, the blocks past it take the prefix hash's sequence: this one goes elsewhere
    hashed = int(BankIndex(8, [40] * 8, recorded).sequences_for(prompt, [40])[0])
    this = (hashed + 1) % 8
    recorded[this] = prompt + generated
    sched = replay_scheduler(tmp_path, recorded)
    req = SimpleNamespace(request_id="r", num_tokens=40, num_preemptions=1, prompt_token_ids=prompt,
                          all_token_ids=prompt + generated)
    assert sched.get_num_new_matched_tokens(req, 0) == (39, False)
    sched.update_state_after_alloc(req, blocks_of(1, 2, 3), 39)
    sel = sched.build_connector_meta(None).selections["r"]
    # blocks end at 16, 32 and 40: past the prompt only sequence `this` holds these tokens
    assert list(sel.groups[0].sequences)[1:] == [this, this]


def test_a_block_of_a_prompt_that_ends_at_its_edge_takes_the_sequence_a_longer_prompt_gives_it(tmp_path):
    """Prefix caching shares a prompt's second block with a longer prompt: a
    prompt of exactly 2 blocks must choose that block by its 32 tokens, as
    the longer prompt does, not by the 31 it fills."""
    from types import SimpleNamespace

    a = list(range(100, 132))                      # 32 tokens: exactly 2 blocks
    b = a + list(range(300, 316))                  # 48: shares both
    recorded = [a[:31] + [7], a]                   # 0 agrees with a on 31 tokens only, 1 on all 32
    sched = replay_scheduler(tmp_path, recorded)
    chosen = {}
    for rid, tokens, blocks in (("a", a, (1, 2)), ("b", b, (1, 2, 3))):
        req = SimpleNamespace(request_id=rid, num_tokens=len(tokens), num_preemptions=0, prompt_token_ids=tokens,
                              all_token_ids=tokens)
        grant, _ = sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, blocks_of(*blocks), grant)
        chosen[rid] = list(sched.build_connector_meta(None).selections[rid].groups[0].sequences)
    assert chosen["a"][1] == chosen["b"][1] == 1


# ------------------------------------------------------------------ one bank everywhere
def bank_of_layers(path, seed=0):
    """A bank for LAYERS (2 KV heads of 8, bf16), saved at ``path``."""
    from kvfill.kernels import Bank

    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = torch.randn(40, 32, generator=g, device="cpu").to(torch.bfloat16)
    Bank({n: rows.clone() for n in LAYERS}, sequence_lengths=[40], sequence_tokens=[list(range(100, 140))],
         kv={n: (2, 8, 8) for n in LAYERS}).save(path)
    return str(path)


def test_positions_past_a_recorded_sequence_are_counted_as_wrapped_and_named_at_start(tmp_path):
    """A prompt longer than the bank's one 40-token sequence (its first 40
    tokens are that sequence's) replays positions 40.. from the sequence's
    start again (row t mod 40): the scheduler counts them per request in
    vLLM's connector stats, which reach /metrics beside the worker's fill
    figures; the start-up line names the longest sequence against
    max_model_len; a prompt within the sequence counts none."""
    from conftest import connector_lines

    path = bank_of_layers(tmp_path / "bank.safetensors")
    with connector_lines() as said:
        h = make_harness(tmp_path / "h", [(LAYERS, FullAttentionSpec(**ATT))],
                         extra={"fill_mode": "replay", "bank": path})
    longest = [line for line in said if "longest recorded sequence" in line]
    assert len(longest) == 1 and "holds 40 positions, max_model_len is " \
        f"{h.config.model_config.max_model_len}" in longest[0], said
    assert "vllm:kvfill_wrapped_positions_total" in longest[0]
    h.add("long", list(range(100, 140)) + list(range(1, 61)), max_tokens=1)  # 100 tokens: 99 filled, 59 past 40
    h.add("within", list(range(100, 130)), max_tokens=1)
    out = h.scheduler.schedule()
    conn = h.scheduler.connector
    stats = conn.get_kv_connector_stats()
    assert stats is not None and (stats.data["wrapped_positions"], stats.data["wrapped_requests"]) == (59, 1)
    assert conn.get_kv_connector_stats() is None  # reset after reporting
    h.worker.bind_connector_metadata(out.kv_connector_metadata)
    h.worker.start_load_kv(None)
    both = h.worker.get_kv_connector_stats().aggregate(stats)  # as vLLM's scheduler sums the two sides
    assert both.reduce()["kvfill_wrapped_positions"] == 59 and both.reduce()["kvfill_requests"] == 2
    with observed(h.config, both.data) as value:
        assert value("vllm:kvfill_wrapped_positions_total") == 59 and value("vllm:kvfill_wrapped_requests_total") == 1


def test_past_bank_rotate_turns_keys_past_the_bank_with_the_models_rotary_embedding(tmp_path, monkeypatch,
                                                                                   vllm_cpu_platform):
    """past_bank 'rotate' through vLLM's connector API: the worker takes the
    model's rotary embedding from vLLM's get_rope (the one the loaded model
    made), gives the replayed layers their rotary keys, and a prompt past the
    bank's 40 positions gets its keys there turned to their true positions
    (rows below 40, and the values, exactly as plain replay writes them);
    the start-up line says so."""
    from conftest import connector_lines
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.layers.rotary_embedding import get_rope

    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {})  # this process's model: one embedding
    with set_current_vllm_config(VllmConfig()):
        get_rope(ATT["head_size"], 4096, is_neox_style=True, rope_parameters={"rope_theta": 10000},
                 dtype=torch.bfloat16)
    path = bank_of_layers(tmp_path / "bank.safetensors")
    written = {}
    for past in ("wrap", "rotate"):
        with connector_lines() as said:
            h = make_harness(tmp_path / past, [(LAYERS, FullAttentionSpec(**ATT))],
                             extra={"fill_mode": "replay", "bank": path, "past_bank": past})
        h.add("long", list(range(100, 140)) + list(range(1, 61)), max_tokens=1)  # 100 tokens: 59 past 40
        out = h.scheduler.schedule()
        h.worker.bind_connector_metadata(out.kv_connector_metadata)
        h.worker.start_load_kv(None)
        written[past] = (h.poison.clone(), h.raw.clone(), said, h.worker.worker.engine.describe())
    (poison, wrap, _, _), (_, rotate, said, held) = written["wrap"], written["rotate"]
    assert any("keys re-rotated to position t (past_bank 'rotate')" in line for line in said), said
    assert "re-rotating 2 layers' keys past each recorded sequence's end" in held, held
    changed = (wrap != rotate).nonzero().flatten()
    assert changed.numel() > 0 and bool((wrap != poison).any())
    assert changed.numel() <= 59 * 2 * 2 * 8 * 2  # at most the 59 positions' K bytes of 2 layers x 2 heads


@pytest.mark.parametrize("recorded", [None, 4096, 131072], ids=["unknown", "short-factors", "long-factors"])
def test_past_bank_rotate_on_longrope_reads_the_max_model_len_the_bank_was_recorded_with(tmp_path, monkeypatch,
                                                                                        recorded):
    """LongRoPE's factors follow max_model_len (long above 4096 here): the
    bank's provenance names the recording's.  Recorded with the engine's
    (long) factors only keys past the end are turned; with the other
    (short) every key is, and the start-up line says so; a bank that does
    not say is refused naming why."""
    from types import SimpleNamespace

    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.layers.rotary_embedding import phi3_long_rope_scaled_rope as longrope

    from kvfill.kernels import Bank

    monkeypatch.setattr(longrope, "get_current_vllm_config",
                        lambda: SimpleNamespace(model_config=SimpleNamespace(max_model_len=131072)))
    monkeypatch.setattr(rotary_embedding, "_ROPE_DICT", {"phi3": longrope.Phi3LongRoPEScaledRotaryEmbedding(
        8, 8, 131072, 4096, 10000.0, True, torch.bfloat16, [1.0] * 4, [1.0 + 3 * i for i in range(4)])})
    bank = Bank.load(bank_of_layers(tmp_path / "plain.safetensors"))
    path = tmp_path / "bank.safetensors"
    Bank(dict(bank.layers), sequence_lengths=[40], sequence_tokens=[list(range(100, 140))],
         kv={n: (2, 8, 8) for n in LAYERS}, metadata={} if recorded is None else {"max_model_len": recorded}).save(path)
    extra = {"fill_mode": "replay", "bank": str(path), "past_bank": "rotate"}
    if recorded is None:
        with pytest.raises(Exception, match=r"the bank does not say the max_model_len it was recorded with"):
            make_harness(tmp_path / "h", [(LAYERS, FullAttentionSpec(**ATT))], extra=extra)
        return
    held = make_harness(tmp_path / "h", [(LAYERS, FullAttentionSpec(**ATT))], extra=extra).worker.worker.engine
    line = held.describe()
    assert "re-rotating 2 layers' keys" in line
    assert ("(every key of 2: the bank was rotated by another table)" in line) == (recorded == 4096), line


def test_a_bank_as_long_as_max_model_len_says_nothing_of_wrapping(tmp_path):
    from conftest import connector_lines

    path = bank_of_layers(tmp_path / "bank.safetensors")
    with connector_lines() as said:
        make_harness(tmp_path / "h", [(LAYERS, FullAttentionSpec(**ATT))], extra={"fill_mode": "replay", "bank": path},
                     max_model_len=40)
    assert not [line for line in said if "longest recorded sequence" in line], said


def replay_connectors(tmp_path, scheduler_bank, worker_banks):
    """vLLM's connector objects as the engine makes them: the scheduler's
    over ``scheduler_bank``, one worker per entry of ``worker_banks`` (its
    bank path, as on its own node) with its caches registered; returns the
    scheduler and the workers' handshakes, keyed (PP rank, TP rank)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_harness import model_dir, vllm_config

    h = make_harness(tmp_path / "scheduler", [(LAYERS, FullAttentionSpec(**ATT))], extra={"bank": scheduler_bank})
    sched = KVConnectorFactory.create_connector(h.config, KVConnectorRole.SCHEDULER, h.kv_cache_config)
    handshakes = {}
    for rank, path in enumerate(worker_banks):
        cfg = vllm_config(model_dir(tmp_path / f"worker{rank}"), num_blocks=64, extra={"bank": path})
        cfg.cache_config.kv_cache_layout = h.config.cache_config.kv_cache_layout
        cfg.cache_config.num_gpu_blocks = h.config.cache_config.num_gpu_blocks
        worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, h.kv_cache_config)
        worker.register_kv_caches(h.views_over(h.poison.clone()))
        got = worker.get_handshake_metadata()
        # each harness is a TP 1 engine: report it as TP rank `rank` of one engine
        handshakes[(0, rank)] = type(got)(got.node, rank, 0, got.path, got.identity)
    return sched, handshakes


def test_workers_holding_copies_of_the_scheduler_bank_start(tmp_path):
    """The same save on every node, at another path on each: accepted."""
    import shutil

    path = bank_of_layers(tmp_path / "bank.safetensors")
    copy = tmp_path / "node1" / "elsewhere.safetensors"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    sched, handshakes = replay_connectors(tmp_path, path, [path, str(copy)])
    assert len({h.identity for h in handshakes.values()}) == 1
    sched.set_xfer_handshake_metadata_pp_aware(handshakes)  # no error


@pytest.mark.parametrize("other", ["another recording", "a re-save of the same rows"])
def test_a_worker_whose_bank_differs_from_the_schedulers_is_refused_at_start_naming_it(tmp_path, other):
    path = bank_of_layers(tmp_path / "bank.safetensors")
    odd = tmp_path / "node1" / "bank.safetensors"
    odd.parent.mkdir()
    bank_of_layers(odd, seed=1 if other == "another recording" else 0)
    sched, handshakes = replay_connectors(tmp_path, path, [path, str(odd)])
    with pytest.raises(ValueError) as err:
        sched.set_xfer_handshake_metadata_pp_aware(handshakes)
    text = str(err.value)
    assert f"the scheduler indexed the bank {path!r}, identity {handshakes[(0, 0)].identity}" in text
    assert f"TP rank 1, PP rank 0 loaded {str(odd)!r}, identity {handshakes[(0, 1)].identity}" in text
    assert "TP rank 0" not in text and "Every node must hold the same bank file" in text


def test_a_worker_whose_bank_is_missing_or_of_another_version_names_its_node_and_rank(tmp_path):
    import socket

    path = bank_of_layers(tmp_path / "bank.safetensors")
    gone = tmp_path / "gone.safetensors"
    with pytest.raises(ValueError, match=rf"^node {socket.gethostname()}, TP rank 0, PP rank 0: .*bank "
                                         rf"'{gone}' does not exist"):
        replay_connectors(tmp_path, path, [str(gone)])
    other = bank_of_layers(tmp_path / "v2.safetensors")
    from test_bank_files import rewrite_metadata

    rewrite_metadata(other, version="2")
    with pytest.raises(ValueError, match=rf"^node {socket.gethostname()}, TP rank 0, PP rank 0: .*bank version "
                                         rf"'2'; this kvfill reads versions \['3', '4'\]"):
        replay_connectors(tmp_path, path, [other])


def test_with_speculative_decoding_the_last_two_prompt_tokens_are_left_to_vllm(tmp_path):
    """vLLM's drafter after a one-token prefill step proposes a first draft
    real prefill does not (scheduler.computed_tail; docs/replay.md): under a
    speculative config every fill ends two tokens before the prompt's end,
    its selection with it; without one, one token before."""
    from types import SimpleNamespace

    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.request import Request

    from kvfill.connector.options import FillOptions
    from kvfill.connector.scheduler import KVFillScheduler

    h = make_harness(tmp_path, [(["model.layers.0.self_attn.attn"], FullAttentionSpec(**ATT))], extra=FILL,
                     prefix_caching=False)
    par = SimpleNamespace(decode_context_parallel_size=1, tensor_parallel_size=1, prefill_context_parallel_size=1,
                          cp_kv_cache_interleave_size=1)
    for spec, grant in ((None, 99), (SimpleNamespace(method="draft_model"), 98), (SimpleNamespace(method="ngram"), 98)):
        manager = KVCacheManager(h.kv_cache_config, max_model_len=2048, scheduler_block_size=BS, hash_block_size=BS,
                                 enable_caching=False)
        sched = KVFillScheduler(SimpleNamespace(parallel_config=par, speculative_config=spec), h.kv_cache_config,
                                FillOptions.from_extra_config(FILL))
        req = Request("r", list(range(1, 101)), SamplingParams(max_tokens=4), None)
        assert sched.get_num_new_matched_tokens(req, 0) == (grant, False)
        assert manager.allocate_slots(req, 100 - grant, num_external_computed_tokens=grant) is not None
        sched.update_state_after_alloc(req, manager.get_blocks(req.request_id), grant)
        sel = sched.build_connector_meta(None).selections["r"]
        assert [(g.token_lo, g.token_hi) for g in sel.groups] == [(0, grant)]
        assert sched.get_num_new_matched_tokens(Request("one", [5, 6], SamplingParams(max_tokens=1), None), 0) == (
            (1 if spec is None else 0), False)


def test_a_bank_without_the_drafters_layers_is_refused_under_speculative_decoding_naming_the_way_out(tmp_path):
    """Served with a drafter whose KV layers the bank lacks (recorded without
    --speculative-config): refused at load, naming the missing layers, the
    method and the way out; without a drafter the same bank loads."""
    from types import SimpleNamespace

    from kvfill.connector.bank_checks import check_drafter_layers
    from kvfill.bank import Bank, BankError, BankPart

    target = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    drafter = [f"draft_model.model.layers.{i}.self_attn.attn" for i in range(2)]
    path = tmp_path / "b.safetensors"
    Bank({n: torch.zeros(4, 8, device="cpu") for n in target}, sequence_lengths=[4]).save(path)
    part = BankPart(0, 1, frozenset(target + drafter))
    bank = Bank.load(path, part)
    check_drafter_layers(bank, part, SimpleNamespace(speculative_config=None))
    check_drafter_layers(bank, BankPart(0, 1, frozenset(target)), SimpleNamespace(
        speculative_config=SimpleNamespace(method="draft_model")))
    with pytest.raises(BankError) as err:
        check_drafter_layers(bank, part, SimpleNamespace(speculative_config=SimpleNamespace(method="draft_model")))
    text = str(err.value)
    assert "has no rows for 2 KV cache layer(s) of this engine (draft_model.model.layers.0.self_attn.attn, " \
           "draft_model.model.layers.1.self_attn.attn)" in text, text
    assert "method 'draft_model'" in text and "recorded with speculative config none" in text, text
    assert "Record the bank with the serving run's --speculative-config" in text, text


def _hybrid_bank(path, attn, mixer, shapes, dtypes, tokens=(range(100, 140), range(200, 230))):
    """A bank of two sequences (40 and 30 tokens: ``tokens``) with rows for
    ``attn`` and one recorded state per sequence for the state layer ``mixer``."""
    from kvfill.bank import Bank
    from kvfill.bank.state import StateTensor

    g = torch.Generator(device="cpu").manual_seed(9)
    lengths = [len(t) for t in tokens]
    rows = torch.randn(sum(lengths), 32, generator=g, device="cpu").to(torch.bfloat16)
    layout = tuple(StateTensor(s, d, 0) for s, d in zip(shapes, dtypes))
    states = [torch.randn((2, *s), generator=g, device="cpu").to(d) for s, d in zip(shapes, dtypes)]
    bank = Bank({attn: rows}, sequence_lengths=lengths,
                sequence_tokens=[list(t) for t in tokens], kv={attn: (2, 8, 8)},
                states={mixer: states}, state_layouts={mixer: layout})
    bank.save(path)
    return bank


HYBRID_ATTN, HYBRID_MIXER = "model.layers.0.self_attn.attn", "model.layers.1.mixer"
HYBRID_STATES = (((2, 8), (2, 4, 4)), (torch.bfloat16, torch.float32))  # the state layer's shapes and dtypes


def _hybrid_harness(tmp_path, mode="none", tokens=(range(100, 140), range(200, 230)), states=HYBRID_STATES,
                    state_alignment=None, **extra):
    """vLLM's scheduler and the connector's worker replaying ``_hybrid_bank``
    over an attention layer and a state layer (mamba_cache_mode ``mode``:
    none - one state block spanning max_model_len - or align, with prefix
    caching, blocks of BS; ``states``: its shapes and dtypes;
    ``state_alignment``: vLLM 0.34's, None: the spec's default); returns the
    harness and the bank."""
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes, dtypes = states
    bank = _hybrid_bank(tmp_path / "bank.safetensors", HYBRID_ATTN, HYBRID_MIXER, shapes, dtypes, tokens)
    page = FullAttentionSpec(**ATT).page_size_bytes
    aligned = {} if state_alignment is None else {"state_alignment": state_alignment}
    mamba = MambaSpec(block_size=256 if mode == "none" else BS, shapes=shapes, dtypes=dtypes,
                      page_size_padded=page, mamba_cache_mode=mode, **aligned)
    h = make_harness(tmp_path, [([HYBRID_ATTN], FullAttentionSpec(**ATT)), ([HYBRID_MIXER], mamba)],
                     extra={"fill_mode": "replay", "bank": str(tmp_path / "bank.safetensors"), **extra},
                     prefix_caching=mode != "none", mamba_cache_mode=mode)
    return h, bank


def test_a_hybrid_replay_writes_the_recorded_state_of_the_requests_sequence_into_its_state_block(tmp_path):
    """vLLM's scheduler and the connector's worker over a poisoned buffer: a
    request whose prompt is a recorded sequence plus one token gets that
    sequence's rows (verified) and, in its state block, that sequence's
    recorded state, packed as vLLM binds it; no other byte changes."""
    from kvfill.bank.state import pack

    attn, mixer = HYBRID_ATTN, HYBRID_MIXER
    h, bank = _hybrid_harness(tmp_path, verify="raise")
    assert h.worker.worker.registration.replayed.groups == {"group1": [mixer]}
    h.add("a", list(range(200, 230)) + [5])
    h.step()  # verify: raise - every written row and state page read back
    full_ids, state_ids = h.block_table("a")
    null = h.scheduler.kv_cache_manager.block_pool.null_block.block_id
    (block,) = [b for b in state_ids if b != null]
    got = h.views[mixer][block].reshape(-1).view(torch.uint8)
    want = pack([s[1:2] for s in bank.states[mixer]])[0]
    assert torch.equal(got[:want.numel()], want)
    w = h.worker.worker  # the state page's bytes count with the rows' (vllm:kvfill_bytes_total)
    assert w.stats.data["bytes"] == w.last_stats.bytes + h.views[mixer][block].numel() * h.views[mixer].element_size()
    expected = h.raw.clone()  # outside the request's attention slots and its state block: the poison
    views = h.views_over(expected)
    for t in range(30):
        views[attn][full_ids[t // BS], :, t % BS] = h.views_over(h.poison)[attn][full_ids[t // BS], :, t % BS]
    views[mixer][block] = h.views_over(h.poison)[mixer][block]
    assert_bytes(expected, h.poison)


def test_a_hybrid_replay_puts_each_state_at_vllms_aligned_offsets(tmp_path):
    """vLLM 0.34's ``MambaSpec.state_alignment`` (16 under FlashInfer's
    ReplaySSM): states of 36 and 72 bytes start at 0 and 48 of a 128-byte
    page. Replayed through vLLM's scheduler, the request's state block holds
    each recorded state where vLLM's own ``MambaBase.bind_kv_cache`` reads
    it, zeros in the alignment gaps, and no other byte changes."""
    from dataclasses import fields

    import vllm.model_executor.layers.mamba.abstract as mamba
    from vllm.v1.kv_cache_interface import MambaSpec

    if "state_alignment" not in {f.name for f in fields(MambaSpec)}:
        pytest.skip("this vLLM's MambaSpec has no state_alignment (vLLM 0.32: states one after another in a page)")
    attn, mixer = HYBRID_ATTN, HYBRID_MIXER
    shapes, dtypes = ((3, 6), (2, 3, 3)), (torch.bfloat16, torch.float32)
    h, bank = _hybrid_harness(tmp_path, states=(shapes, dtypes), state_alignment=16, verify="raise")
    assert h.views[mixer].shape[1:] == (1, 1, 128)  # vLLM's view: the aligned content, 48 + 80 bytes
    h.add("a", list(range(200, 230)) + [5])
    h.step()
    full_ids, state_ids = h.block_table("a")
    null = h.scheduler.kv_cache_manager.block_pool.null_block.block_id
    (block,) = [b for b in state_ids if b != null]

    class Layer:  # vLLM's state layer as bind_kv_cache sees it
        state_alignment = 16

        def get_state_shape(self):
            return shapes

        def get_state_dtype(self):
            return dtypes

    layer = Layer()
    mamba.MambaBase.bind_kv_cache(layer, h.views[mixer])
    for got, recorded in zip(layer.kv_cache, bank.states[mixer]):
        assert torch.equal(got[block], recorded[1])  # sequence 1: the 30-token prompt
    page = h.views[mixer][block].reshape(-1).view(torch.uint8)
    assert (page[36:48] == 0).all() and (page[120:128] == 0).all()
    expected = h.raw.clone()  # outside the request's attention slots and its state block: the poison
    views, poison = h.views_over(expected), h.views_over(h.poison)
    for t in range(30):
        views[attn][full_ids[t // BS], :, t % BS] = poison[attn][full_ids[t // BS], :, t % BS]
    views[mixer][block] = poison[mixer][block]
    assert_bytes(expected, h.poison)


def test_a_prompt_recorded_beside_a_longer_one_it_begins_gets_its_own_state_and_one_without_its_own_none(tmp_path):
    """Recorded prompts P (30 tokens) and P + 10 more: a request for P plus
    its last token (31, filled 30) gets P's state - the sequence recorded at
    exactly its filled length - not the longer one's, though the longer one
    covers more of its tokens (issue 38: 0/8 tokens, silently); a request
    filled to 20, a length no sequence was recorded at, is not filled (vLLM
    prefills it) rather than given a state after other tokens."""
    from kvfill.bank.state import pack

    long, short = range(100, 140), range(100, 130)
    h, bank = _hybrid_harness(tmp_path, tokens=(long, short), verify="raise")
    sched = h.scheduler.connector.scheduler
    h.add("a", list(range(100, 131)))  # the first 31 tokens of the longer prompt
    h.step()
    _, state_ids = h.block_table("a")
    null = h.scheduler.kv_cache_manager.block_pool.null_block.block_id
    (block,) = [b for b in state_ids if b != null]
    got = h.views[HYBRID_MIXER][block].reshape(-1).view(torch.uint8)
    want = pack([s[1:2] for s in bank.states[HYBRID_MIXER]])[0]  # sequence 1: the 30-token one
    assert torch.equal(got[:want.numel()], want)
    other = h.add("b", list(range(100, 121)))  # filled 20: no sequence recorded at 20 positions
    assert sched.get_num_new_matched_tokens(other, 0) == (0, False)


def test_hybrid_replay_recomputes_a_preempted_request_and_refuses_an_unknown_state_cache_mode(tmp_path):
    from kvfill.connector.scheduler import KVFillScheduler

    h, _ = _hybrid_harness(tmp_path)
    sched = h.scheduler.connector.scheduler
    req = h.add("a", list(range(200, 230)) + [5])
    assert sched.get_num_new_matched_tokens(req, 0) == (30, False)
    sched.filled["a"] = 0
    req.num_preemptions = 1  # preempted after its fill: recomputed, not filled again
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    h.config.cache_config.mamba_cache_mode = "align"  # prefix caching on a hybrid: its running block (planner)
    KVFillScheduler(h.config, h.kv_cache_config, sched.options)
    h.config.cache_config.mamba_cache_mode = "all"
    with pytest.raises(ValueError, match=r"mamba_cache_mode in \('none', 'align'\), this engine runs 'all'"):
        KVFillScheduler(h.config, h.kv_cache_config, sched.options)


@pytest.mark.parametrize("prompt,seq,index,first", [
    (list(range(200, 230)) + [5], 1, 1, range(100, 140)),  # 31 tokens: state block 1
    (list(range(100, 132)) + [5], 0, 2, range(100, 132))])  # 33: block 2, past the fill (recorded at 32)
def test_with_prefix_caching_the_state_goes_to_the_running_block_past_null_blocks(tmp_path, prompt, seq, index,
                                                                                 first):
    """mamba_cache_mode align (vLLM's choice with prefix caching on a hybrid):
    a request's state blocks before its running one - the block of its last
    token, past the filled tokens when the fill ends at a block boundary - are
    null (or vLLM's prefill checkpoint, which vLLM writes); the recorded
    state goes into the running block, nothing else changes."""
    from kvfill.bank.state import pack

    attn, mixer = HYBRID_ATTN, HYBRID_MIXER
    h, bank = _hybrid_harness(tmp_path, mode="align", tokens=(first, range(200, 230)), verify="raise")
    h.add("a", prompt)
    h.step()
    full_ids, state_ids = h.block_table("a")
    null = h.scheduler.kv_cache_manager.block_pool.null_block.block_id
    # the running block last; before it null blocks, or vLLM's prefill checkpoint block (its own to write)
    assert max(i for i, b in enumerate(state_ids) if b != null) == index
    got = h.views[mixer][state_ids[index]].reshape(-1).view(torch.uint8)
    want = pack([s[seq:seq + 1] for s in bank.states[mixer]])[0]
    assert torch.equal(got[:want.numel()], want)
    expected = h.raw.clone()
    views, poison = h.views_over(expected), h.views_over(h.poison)
    for t in range(len(prompt) - 1):
        views[attn][full_ids[t // BS], :, t % BS] = poison[attn][full_ids[t // BS], :, t % BS]
    views[mixer][state_ids[index]] = poison[mixer][state_ids[index]]
    assert_bytes(expected, h.poison)


def test_verify_reads_every_replayed_state_page_back(tmp_path, monkeypatch):
    """verify: raise compares each state block with the recorded state it was
    to get: a state write that went nowhere is an error naming the pages."""
    from kvfill.kernels.state_pages import StatePages, StateWrite

    h, _ = _hybrid_harness(tmp_path, verify="raise")
    monkeypatch.setattr(StatePages, "write", lambda self, blocks: StateWrite(0, 0, 0))
    h.add("a", list(range(200, 230)) + [5])
    with pytest.raises(RuntimeError, match=r"verify found 0 of \d+ elements and 1 of 1 state pages mismatched"):
        h.step()


def test_verify_checks_each_state_blocks_sequence_against_the_rule(tmp_path, monkeypatch):
    """verify: raise also checks that a state block replays the sequence
    recorded at exactly the request's filled length (issue 38): a scheduler
    that picked another sequence (here the 40-position one for a 30-token
    fill: the state after ten other tokens) is an error naming the request."""
    from kvfill.bank.index import BankIndex

    h, _ = _hybrid_harness(tmp_path, verify="raise")
    h.add("a", list(range(200, 230)) + [5])  # its own sequence: 1, recorded at 30
    h.step()
    monkeypatch.setattr(BankIndex, "state_sequence", lambda self, ids, n: 0)  # sequence 0: recorded at 40
    h.add("b", list(range(200, 230)) + [6])
    with pytest.raises(RuntimeError, match=r"1 state blocks replay a sequence not recorded at the request's filled "
                                           r"length, first: \['request b: state of sequence 0 \(recorded at 40 "
                                           r"positions\), filled 30'\]"):
        h.step()


def test_vllms_v2_runner_drives_the_fill_through_its_connector_helper(tmp_path):
    """vLLM's V2 model runner (the GPU default) calls connectors through
    ``v1/worker/gpu/kv_connector.ActiveKVConnector``: ``pre_forward`` binds
    the metadata and, for kvfill's synchronous loads, calls ``start_load_kv``
    before the forward with the runner's extra keyword arguments;
    ``post_forward`` collects the step's output.  Driven here over the
    harness's caches (its worker already registered them, as the helper's
    constructor does), the request's slots are filled and verified and the
    step's stats reach the output."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.distributed.kv_transfer.kv_connector.utils import copy_kv_blocks
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra={**FILL, "verify": "raise"})
    h.worker.set_host_xfer_buffer_ops(copy_kv_blocks)  # what the helper's constructor calls after registering
    helper = ActiveKVConnector.__new__(ActiveKVConnector)
    helper.vllm_config, helper.kv_connector = h.config, h.worker
    helper._pending_load_kwargs, helper._disabled = None, False
    saved = kv_transfer_state._KV_CONNECTOR_AGENT
    kv_transfer_state._KV_CONNECTOR_AGENT = h.worker
    try:
        h.add("a", list(range(1, 41)))
        out = h.scheduler.schedule()
        assert out.has_sync_kv_loads
        req_ids = list(out.num_scheduled_tokens)
        batch = SimpleNamespace(idx_mapping=torch.arange(len(req_ids), device="cpu"), req_ids=req_ids,
                                num_tokens=sum(out.num_scheduled_tokens.values()))
        helper.pre_forward(out, batch, attn_metadata={})  # verify: raise reads every filled slot back
        helper.finish_forward()
        output = helper.post_forward(set())
    finally:
        kv_transfer_state._KV_CONNECTOR_AGENT = saved
    assert h.worker.worker.last_stats.slots == 39 * len(LAYERS)
    assert not output.invalid_block_ids
    assert output.kv_connector_stats is not None and output.kv_connector_stats.data["requests"] == 1
    assert (h.raw != h.poison).any()


def test_a_refused_request_fails_alone_and_the_rest_of_its_step_is_filled(tmp_path, monkeypatch):
    """Two requests in one step, the engine refusing any plan that holds
    one of them (a request whose metadata the caches cannot take): before,
    the whole step was skipped - the valid request's blocks reported too, so
    it came back failed with it (issue 61, finding 2).  Now the other is
    filled, and only the refused one's blocks go to vLLM's policy."""
    from kvfill.kernels import FillEngine

    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)
    h.add("a", list(range(1, 41)))
    h.add("b", list(range(101, 141)))
    out = h.scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    refused = set(h.block_table("b")[0])
    fill = FillEngine.fill

    def refuses_b(self, plan):
        if any(set(e.block_ids.tolist()) & refused for e in plan.groups.values()):
            raise ValueError("a block of 'b' does not fit the caches")
        return fill(self, plan)

    monkeypatch.setattr(FillEngine, "fill", refuses_b)
    before = h.raw.clone()
    h.worker.bind_connector_metadata(out.kv_connector_metadata)
    h.worker.start_load_kv(None)
    h.worker.clear_connector_metadata()
    assert h.worker.get_block_ids_with_load_errors() == set(h.block_table("b")[0][:3])
    stats = h.worker.worker.stats.data
    assert stats["requests"] == 1 and stats["bytes"] == 2 * 39 * 32 * 2  # a's, whole
    expected = before.clone()  # a's 39 slots of each layer filled alone, in a copy: the bytes written are those
    monkeypatch.setattr(FillEngine, "fill", fill)
    single = make_harness(tmp_path / "alone", [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)
    single.raw.copy_(expected)
    single.add("a", list(range(1, 41)))
    single.step()
    assert torch.equal(h.raw, single.raw) and not torch.equal(h.raw, before)
