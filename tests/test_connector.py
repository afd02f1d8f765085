"""KVFillConnector through vLLM's real Scheduler and the worker connector over
real CPU caches in vLLM's standard layout, in poisoned memory."""
import pytest
import torch

pytest.importorskip("vllm")
from oracle import row_bits, write_expected  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402
from vllm_harness import make_harness  # noqa: E402

from kvfill.kernels import values as V  # noqa: E402

BS = 16
ATT = dict(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
FILL = {"fill_mean": 0.1, "fill_std": 0.5, "seed": 5}
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def expected_after(h, fills, *, mean=0.1, std=0.5, seed=5, mode=None):
    """The poisoned buffer with exactly ``fills`` applied by the oracle.

    fills: [(layer name, block, slot, position)]"""
    expected = h.poison.clone()
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


def assert_bytes(actual, expected):
    diff = (actual != expected).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at {diff[:6].tolist()}"


@pytest.fixture
def full(tmp_path):
    return make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)


def test_prompt_minus_last_token_is_filled_and_nothing_else(full):
    h = full
    h.add("a", list(range(1, 41)))
    out, meta = h.step()
    assert out.num_scheduled_tokens["a"] == 1  # only the last prompt token is computed
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
    h.poison, saved = before, h.poison
    try:
        expected = expected_after(h, fills)
    finally:
        h.poison = saved
    assert_bytes(h.raw, expected)


def test_hybrid_groups_each_get_their_own_blocks_and_null_padding_is_skipped(tmp_path):
    sw = ["model.layers.1.self_attn.attn"]
    full_layers = ["model.layers.0.self_attn.attn"]
    h = make_harness(
        tmp_path,
        [(full_layers, FullAttentionSpec(**ATT)), (sw, SlidingWindowSpec(**ATT, sliding_window=32))],
        extra=FILL,
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
