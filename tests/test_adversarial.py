"""Adversarial inputs: each gets a clear error or a defined no-op; never a
crash of the worker, never a stray write."""
import numpy as np
import pytest
import torch
from oracle import poisoned_buffer

from kvfill.kernels import CacheGroup, FillEngine, GroupFill


def test_duplicate_entries_in_one_plan_are_idempotent(backend):
    a, b = torch.zeros(6, 2, 4, 8), torch.zeros(6, 2, 4, 8)
    ea = FillEngine({"g": CacheGroup({"l": a})}, mean=0.0, std=1.0, backend=backend)
    eb = FillEngine({"g": CacheGroup({"l": b})}, mean=0.0, std=1.0, backend=backend)
    ea.fill({"g": GroupFill([3, 1, 3, 3], [0, 1, 0, 0], [4, 3, 4, 4], [8, 0, 8, 8])})
    eb.fill({"g": GroupFill([3, 1], [0, 1], [4, 3], [8, 0])})
    assert torch.equal(a, b) and a[3].abs().sum() > 0


def test_zero_size_caches_register_and_refuse_every_block(backend):
    empty = torch.zeros(0, 2, 4, 8)
    eng = FillEngine({"g": CacheGroup({"l": empty})}, mean=1.0, backend=backend)
    assert eng.fill({"g": GroupFill([])}).slots == 0
    assert eng.fill_all().slots == 0
    with pytest.raises(ValueError, match=r"0 <= block id < 0"):
        eng.fill({"g": GroupFill([0])})


def test_offsets_past_2_31_elements_are_addressed_in_int64(backend):
    """Block 2 starts 2**31 bytes into a uint8 cache: an int32 offset would wrap
    to a negative address.  The buffer is virtual; only touched pages are real."""
    stride = 1 << 30
    big = torch.empty(2 * stride + 4096, dtype=torch.uint8)
    cache = big.as_strided((3, 4, 8), (stride, 8, 1))  # [block, slot, element], fp8 e4m3 bytes
    for b in range(3):
        cache[b].fill_(0xAB)
    big[stride - 64 : stride].fill_(0xCD)  # just before block 1
    eng = FillEngine({"g": CacheGroup({"l": cache}, slot_dim=1, encoding="fp8_e4m3")}, mean=1.0, backend=backend)
    eng.fill({"g": GroupFill([2, 0], [1, 0], [3, 4], [0, 0])})
    one = torch.tensor(1.0).to(torch.float8_e4m3fn).view(torch.uint8).item()
    assert (cache[2, 1:3] == one).all() and (cache[2, [0, 3]] == 0xAB).all()
    assert (cache[0] == one).all() and (cache[1] == 0xAB).all()
    assert (big[stride - 64 : stride] == 0xCD).all()
    assert eng.verify({"g": GroupFill([2, 0], [1, 0], [3, 4], [0, 0])}).ok


def test_bad_plan_arrays_never_reach_the_kernel(backend):
    buf = poisoned_buffer(4 * 2 * 4 * 8 * 2)
    cache = buf.view(torch.bfloat16).view(4, 2, 4, 8)
    poison = buf.clone()
    eng = FillEngine({"g": CacheGroup({"l": cache})}, mean=1.0, backend=backend)
    for bad in (
        GroupFill(np.array([[1, 2]])),                     # 2-D ids
        GroupFill([1], local_base=[2**31 - 2]),            # token index past int32
        GroupFill([1], slot_start=[0], slot_end=[5]),      # slot past the block
    ):
        with pytest.raises(ValueError):
            eng.fill({"g": bad})
    assert torch.equal(buf, poison)


@pytest.mark.cpu_only
class TestConnector:
    """Through the vLLM harness (real Scheduler, worker connector, CPU caches)."""

    @pytest.fixture
    def h(self, tmp_path):
        pytest.importorskip("vllm")
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm_harness import make_harness

        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
        layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
        return make_harness(tmp_path, [(layers, spec)], extra={"fill_std": 0.5})

    def test_metadata_from_another_engine_configuration_is_skipped_with_an_error(self, h, caplog):
        from kvfill.connector import KVFillConnectorMetadata

        before = h.raw.clone()
        for meta in (
            KVFillConnectorMetadata(reqs_to_fill={"x": (([1, 10_000],), 20)}),  # id past the caches
            KVFillConnectorMetadata(reqs_to_fill={"x": (([1], [2]), 20)}),      # two groups, one here
        ):
            h.worker.bind_connector_metadata(meta)
            h.worker.start_load_kv(None)
            h.worker.clear_connector_metadata()
        assert torch.equal(h.raw, before)
        assert h.worker.worker.last_stats is None

    def test_request_aborted_between_scheduling_and_fill(self, h):
        from vllm.v1.request import RequestStatus

        h.add("a", list(range(1, 41)))
        out = h.scheduler.schedule()
        table = h.block_table("a")[0]
        h.scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
        assert "a" not in h.scheduler.connector.scheduler.filled
        h.worker.bind_connector_metadata(out.kv_connector_metadata)
        h.worker.start_load_kv(None)  # fills the (now free) blocks; no crash
        name = "model.layers.0.self_attn.attn"
        got = h.views[name][table[0]].contiguous().view(torch.int16)
        assert not torch.equal(got, h.views_over(h.poison)[name][table[0]].contiguous().view(torch.int16))

    def test_caches_missing_a_layer_still_fill_the_others(self, h):
        name0, name1 = list(h.views)
        h.worker.register_kv_caches({name0: h.views[name0]})
        h.add("a", list(range(1, 41)))
        h.step()
        poison_views = h.views_over(h.poison)

        def bits(t):  # poison holds NaNs: compare bits, not values
            return t.contiguous().view(torch.int16)

        assert torch.equal(bits(h.views[name1]), bits(poison_views[name1]))
        assert not torch.equal(bits(h.views[name0]), bits(poison_views[name0]))

    def test_verify_option_logs_or_raises_on_a_mismatch(self, tmp_path, monkeypatch):
        pytest.importorskip("vllm")
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm_harness import make_harness

        from kvfill.kernels.torch_fill import TorchBackend

        spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
        h = make_harness(tmp_path, [(["model.layers.0.self_attn.attn"], spec)],
                         extra={"fill_std": 0.5, "verify": True})
        h.add("a", list(range(1, 41)))
        h.step()  # a clean fill verifies
        # A broken backend: writes nothing. verify must catch it.
        monkeypatch.setattr(TorchBackend, "fill", lambda self, plan: 0)
        h.add("b", list(range(100, 140)))
        with pytest.raises(RuntimeError, match=r"verify found \d+ of \d+ elements mismatched"):
            h.step()


@pytest.mark.parametrize("entries, pair", [
    # (block, slot_start, slot_end, local_base, sequence); the two entries named in the error
    ([(2, 0, 4, 0, 0), (2, 0, 4, 8, 0)], (0, 1)),                      # a block planned for two positions
    ([(2, 0, 4, 0, 0), (1, 0, 4, 4, 0), (2, 3, 4, 8, 0)], (0, 2)),     # overlapping at slot 3
    ([(5, 0, 4, 0, 0), (5, 0, 1, 0, 0), (5, 2, 3, 16, 0)], (0, 2)),     # reaches back past an agreeing entry
])
def test_two_writers_of_one_slot_with_other_values_are_refused_and_nothing_is_written(backend, entries, pair):
    buf = poisoned_buffer(6 * 2 * 4 * 8 * 4, seed=2)
    cache = buf.view(torch.float32).view(6, 2, 4, 8)
    eng = FillEngine({"g": CacheGroup({"l": cache})}, mean=0.0, std=1.0, backend=backend)
    plan = GroupFill(*[list(c) for c in zip(*[e[:4] for e in entries])])
    i, j = pair
    with pytest.raises(ValueError, match=rf"group 'g' entries {i} and {j} both write block \d+ slot \d+ with "
                                         r"other values .*expected entries that write one slot to agree"):
        eng.fill({"g": plan})
    assert torch.equal(buf, poisoned_buffer(buf.numel(), seed=2))


def test_two_writers_of_one_slot_from_other_sequences_are_refused():
    plan = GroupFill([3, 3, 3], [0, 0, 1], [4, 2, 2], [0, 0, 0], sequence=[0, 0, 1]).normalized(4)
    with pytest.raises(ValueError, match=r"group 'g' entries 0 and 2 both write block 3 slot 1 with other values "
                                         r"\(local_base 0 vs 0, sequence 0 vs 1\)"):
        plan.validate("g", num_blocks=6, slots_per_block=4, num_sequences=2)


def test_writers_that_agree_may_overlap():
    """Repeated and nested entries with the same token positions are one writer."""
    a, b = torch.zeros(6, 2, 4, 8), torch.zeros(6, 2, 4, 8)
    FillEngine({"g": CacheGroup({"l": a})}, std=1.0).fill(
        {"g": GroupFill([2, 2, 2], [0, 1, 2], [4, 3, 4], [8, 8, 8])})
    FillEngine({"g": CacheGroup({"l": b})}, std=1.0).fill({"g": GroupFill([2], [0], [4], [8])})
    assert torch.equal(a, b) and a[2].abs().sum() > 0
