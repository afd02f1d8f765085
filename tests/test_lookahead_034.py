"""vLLM's prefill lookahead under a multi-module MTP drafter
(docs/vllm-internals.md, "The prefill lookahead"): a real ``VllmConfig``
whose ``SpeculativeConfig`` is DeepSeek-V3 MTP with several modules, no
engine.  vLLM's own functions are the oracles: its NIXL connector's
back-off for the tail, its ``SlidingWindowManager`` (specs tagged with
``extra_retained_tokens`` by vLLM's own planning) for the window's blocks,
and its drafter's ``cache_inputs`` kernel for what a re-prefill reads.
vLLM 0.34.0 (make test's 0.34 lane) and vLLM CPU 0.32 both have these;
a vLLM without ``num_prefill_lookahead_tokens`` skips them.
"""
import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.cpu_only  # the harness runs vLLM's CPU build, vLLM's drafter kernel Triton's interpreter
from vllm.config import VllmConfig  # noqa: E402

if not hasattr(VllmConfig, "num_prefill_lookahead_tokens"):
    pytest.skip("this vLLM has no prefill lookahead (VllmConfig.num_prefill_lookahead_tokens)",
                allow_module_level=True)

import vllm_harness  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.kv_cache_interface import SlidingWindowSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvfill.connector.options import FillOptions  # noqa: E402
from kvfill.connector.scheduler import KVFillScheduler, computed_tail  # noqa: E402

BS = 16
ATT = dict(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
FILL = {"fill_mean": 0.1, "fill_std": 0.5, "seed": 5}
TARGET = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
MTP = [f"model.layers.{i}.self_attn.attn" for i in range(2, 6)]  # one layer per MTP module
DEEPSEEK = {  # a tiny DeepSeek-V3 with 5 MTP modules: vLLM makes it a multi-module MTP drafter
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
    "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
    "num_nextn_predict_layers": 5, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek-mtp")
    (path / "config.json").write_text(json.dumps(DEEPSEEK))
    return str(path)


def mtp_config(model, modules: int, *, extra=None, num_blocks=None, **_) -> VllmConfig:
    """vLLM's config of a target drafting ``modules`` tokens with its MTP
    modules (the harness's config otherwise; ``_``: its other options)."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig)

    mc = ModelConfig(model=model, skip_tokenizer_init=True, max_model_len=2048, dtype="bfloat16")
    par = ParallelConfig()
    spec = SpeculativeConfig(method="mtp", num_speculative_tokens=modules, target_model_config=mc,
                             target_parallel_config=par)
    kt = KVTransferConfig(kv_connector="KVFillConnector", kv_role="kv_both",
                          kv_connector_module_path="kvfill.connector", kv_connector_extra_config=dict(extra or {}))
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), model_config=mc, parallel_config=par,
                        speculative_config=spec, kv_transfer_config=kt,
                        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=False,
                                                 num_gpu_blocks_override=num_blocks),
                        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048,
                                                         max_model_len=2048, is_encoder_decoder=False))
    config.cache_config.kv_cache_layout = "LBNHC"  # what the engine core's resolution records
    return config


def nixl_backoff(config) -> int:
    """The prompt tokens vLLM's NIXL connector leaves its decoder to compute
    for an attention model (neither Mamba nor bounded replay), by its own method."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler

    return NixlBaseConnectorScheduler._prefill_backoff(
        SimpleNamespace(_has_mamba=False, _bounded_replay=False, vllm_config=config))


def tagged_groups(config, window: int) -> list:
    """(layer names, spec) of each KV cache group vLLM's planning makes of
    TARGET and MTP as sliding-window layers - each spec given its
    ``extra_retained_tokens`` by vLLM (0.34: ``get_global_kv_cache_groups``;
    0.32: inside ``get_kv_cache_configs``)."""
    specs = {n: SlidingWindowSpec(**ATT, sliding_window=window) for n in TARGET + MTP}
    try:
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs

        groups = get_kv_cache_configs(config, [specs], [1 << 30])[0].kv_cache_groups
    else:
        groups = get_global_kv_cache_groups(config, [specs])
    return [(list(g.layer_names), g.kv_cache_spec) for g in groups]


def kv_cache_config(config, groups):
    """vLLM's KV cache config of ``groups`` (as the harness makes one)."""
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    return vllm_harness.get_kv_cache_config_from_groups(
        config, [KVCacheGroupSpec(names, spec) for names, spec in groups], available_memory=1 << 30)


def planned_slots(sched, sel) -> set:
    """(block, slot) of every slot the planner plans for one selection."""
    out = set()
    for fill in sched.planner.plan([sel]).groups.values():
        for b, lo, hi in zip(fill.block_ids.tolist(), fill.slot_start.tolist(), fill.slot_end.tolist()):
            out |= {(b, s) for s in range(lo, hi)}
    return out


# ------------------------------------------------------------------ (1) the tail
@pytest.mark.parametrize("modules, tail", [(2, 2), (3, 2), (4, 3), (5, 4)])
def test_the_computed_tail_is_nixls_back_off_where_that_is_more_than_two(model, modules, tail):
    """vLLM's NIXL connector leaves its decoder the last L - 1 prompt
    tokens (L the lookahead: one per MTP module); kvfill leaves vLLM its
    last two under any drafter, and L - 1 where that is more - its grant
    ends there."""
    config = mtp_config(model, modules)
    assert config.num_prefill_lookahead_tokens == modules
    assert computed_tail(config) == max(2, nixl_backoff(config)) == tail
    sched = KVFillScheduler(config, kv_cache_config(config, tagged_groups(config, 32)),
                            FillOptions.from_extra_config(FILL))
    req = Request("r", list(range(1, 101)), SamplingParams(max_tokens=4), None)
    assert sched.get_num_new_matched_tokens(req, 0) == (100 - tail, False)


# ------------------------------------------------------------------ (2) the window's blocks
@pytest.mark.parametrize("window", [17, 32, 40])
def test_sliding_window_blocks_filled_are_the_ones_vllms_manager_keeps_with_extra_retained_tokens(model, window):
    """Lookahead 4: vLLM tags the window with 3 extra retained tokens and
    its SlidingWindowManager keeps their blocks (nulls only the blocks
    below ``get_num_skipped_tokens``).  kvfill fills exactly the external
    positions of the blocks vLLM keeps - every position its attention
    reads below the first computed one among them - and no block it nulls;
    the grant ends where vLLM's NIXL connector's would."""
    config = mtp_config(model, 4)
    groups = tagged_groups(config, window)
    assert [g[1].extra_retained_tokens for g in groups] == [config.num_prefill_lookahead_tokens - 1] == [3]
    kvc = kv_cache_config(config, groups)
    kept_for_retained = False
    for n in (20, 40, 97, 100, 106, 130):
        manager = KVCacheManager(kvc, max_model_len=2048, scheduler_block_size=BS, hash_block_size=BS,
                                 enable_caching=False)
        sched = KVFillScheduler(config, kvc, FillOptions.from_extra_config(FILL))
        req = Request("r", list(range(1, n + 1)), SamplingParams(max_tokens=4), None)
        grant, _ = sched.get_num_new_matched_tokens(req, 0)
        first = n - max(2, nixl_backoff(config))  # the first position vLLM computes
        assert grant == first, (n, window)
        assert manager.allocate_slots(req, n - grant, num_external_computed_tokens=grant) is not None
        sched.update_state_after_alloc(req, manager.get_blocks("r"), grant)
        table = manager.get_block_ids("r")[0]
        null = manager.block_pool.null_block.block_id
        skipped = manager.coordinator.single_type_managers[0].get_num_skipped_tokens(first)
        assert all(table[t // BS] != null for t in range(skipped, first))  # vLLM keeps what it reads
        kept = {(table[t // BS], t % BS) for t in range(first) if table[t // BS] != null}
        assert planned_slots(sched, sched.build_connector_meta(None).selections["r"]) == kept, (n, window)
        # a block kept only for the retained tokens: wholly below the window without them
        kept_for_retained |= any(table[j] != null and (j + 1) * BS <= first - window + 1 for j in range(len(table)))
    assert kept_for_retained


# ------------------------------------------------------------------ (3) replay and the MTP layers
def cached_reprefill_inputs(monkeypatch, query_inputs: list[int], modules: int) -> list[int]:
    """The draft inputs vLLM's multi-module MTP drafter caches for the next
    step's re-prefill after a step whose query (one request) had
    ``query_inputs``, by its own ``cache_inputs`` kernel; -1 where it wrote
    none.  vLLM CPU leaves its Triton kernels as plain functions: they run
    in Triton's interpreter here."""
    import types

    import triton
    import triton.language as tl
    from vllm.v1.worker.gpu.spec_decode.multi_module_mtp import speculator as S

    if isinstance(S._cache_inputs_kernel, types.FunctionType):
        monkeypatch.setattr(S, "triton", triton)
        monkeypatch.setattr(S, "tl", tl)
        monkeypatch.setattr(S, "_cache_inputs_kernel", triton.jit(S._cache_inputs_kernel))
    q = len(query_inputs)
    buffers = SimpleNamespace(input_ids=torch.tensor(query_inputs, dtype=torch.int64),
                              query_start_loc=torch.tensor([0, q], dtype=torch.int32))
    cached = torch.full((1, modules - 1), -1, dtype=torch.int64)
    S.cache_inputs(buffers, None, torch.zeros(q, 8), cached, None, torch.zeros(1, modules - 1, 8),
                   torch.tensor([q - 1]), torch.tensor([0], dtype=torch.int32), 1, modules, False)
    return cached[0].tolist()


def test_replay_leaves_no_mtp_layer_slot_unwritten_that_vllm_reads(model, tmp_path, monkeypatch):
    """A replayed request under a 4-module MTP drafter, through vLLM's
    scheduler and kvfill's worker over poisoned caches (sliding window 32,
    tagged by vLLM): the step's query holds the prompt's last 3 positions,
    so the drafter's re-prefill after a rejection finds every input it
    reads cached for this request (vLLM's own kernel); below the query
    every position vLLM's attention reads, in every layer - the MTP
    modules' included - is written by the replay (its bytes are no
    longer the poison's)."""
    from kvfill.kernels import Bank

    n, modules = 100, 4
    prompt = list(range(100, 100 + n))
    path = tmp_path / "bank.safetensors"
    g = torch.Generator(device="cpu").manual_seed(0)
    Bank({name: torch.randn(n, 32, generator=g, device="cpu").to(torch.bfloat16) for name in TARGET + MTP},
         sequence_lengths=[n], sequence_tokens=[prompt], kv={name: (2, 8, 8) for name in TARGET + MTP}).save(path)
    groups = tagged_groups(mtp_config(model, modules), 32)
    monkeypatch.setattr(vllm_harness, "vllm_config", lambda _path, **kw: mtp_config(model, modules, **kw))
    h = vllm_harness.make_harness(tmp_path / "h", groups, extra={"fill_mode": "replay", "bank": str(path)})
    h.add("a", prompt)
    out, _ = h.step()
    first = out.scheduled_new_reqs[0].num_computed_tokens
    assert first + out.num_scheduled_tokens["a"] == n
    # the drafter's inputs at the query's positions: the next prompt token, the sampled one (7) at the end
    inputs = prompt[first + 1:] + [7]
    cached = cached_reprefill_inputs(monkeypatch, inputs, modules)
    assert -1 not in cached, f"a re-prefill of {modules - 1} positions reads inputs this request never cached: {cached}"
    assert cached == inputs[-(modules - 1):]
    poison = h.views_over(h.poison)
    table = h.block_table("a")[0]
    null = h.scheduler.kv_cache_manager.block_pool.null_block.block_id
    skipped = h.scheduler.kv_cache_manager.coordinator.single_type_managers[0].get_num_skipped_tokens(first)

    def slot_bytes(views, name, t):  # bytes, not values: poisoned bf16 holds NaNs, unequal to themselves
        return views[name][table[t // BS], :, t % BS].contiguous().view(torch.uint8)

    unwritten = [(name, t) for name in TARGET + MTP for t in range(skipped, first)
                 if table[t // BS] == null or torch.equal(slot_bytes(h.views, name, t), slot_bytes(poison, name, t))]
    assert not unwritten
