"""The connector hooks vLLM 0.33 and 0.34 add or change, driven directly where
vLLM 0.32 (installed here) never calls them: sleep mode's unregister/restore,
the groups a load fills, the config info
gauge, a grant dropped for routed experts, and a vLLM build without CPU ops."""
import functools
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.cpu_only  # the harness runs vLLM's CPU build

from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm_harness import make_harness  # noqa: E402

ATT = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
FILL = {"fill_mean": 0.1, "fill_std": 0.5, "seed": 5}


def test_restore_after_sleep_writes_the_startup_fill_again_and_unregister_keeps_the_engine(tmp_path):
    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra={**FILL, "startup_fill": True})
    engine = h.worker.worker.engine
    whole = engine.whole_plan()
    assert engine.verify(whole).ok
    assert h.worker.unregister_kv_caches() is None  # sleep: vLLM discards the memory
    g = torch.Generator(device="cpu").manual_seed(8)
    h.raw.copy_(torch.randint(0, 256, h.raw.shape, dtype=torch.uint8, generator=g, device="cpu"))  # on wake
    assert not engine.verify(whole).ok
    h.worker.restore_kv_caches()
    assert h.worker.worker.engine is engine and engine.verify(whole).ok


def test_restore_without_a_startup_fill_writes_nothing(tmp_path):
    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)
    h.worker.restore_kv_caches()
    assert torch.equal(h.raw, h.poison)


def test_loaded_groups_are_the_groups_kvfill_fills(tmp_path):
    from kvfill.connector.specs import filled_group_ids

    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)
    req = h.add("a", list(range(1, 40)))
    assert h.worker.get_loaded_kv_cache_group_ids(req) == (0,)
    raw = SimpleNamespace(has_layer_views=False)  # HiSparse-like: the layer lays out its raw buffer itself
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=FullAttentionSpec(**ATT)),
                                              SimpleNamespace(kv_cache_spec=raw)])
    assert filled_group_ids(config) == (0,)


def test_the_config_info_gauge_names_mode_granularity_backend_and_bank(tmp_path, monkeypatch):
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm_harness import model_dir, vllm_config
    from vllm_platform import cpu_platform_stand_in

    cpu_platform_stand_in(monkeypatch)  # "auto" resolves by the platform: vLLM CPU's here (torch)

    from kvfill.connector.metadata import KVFillPromMetrics

    reg = CollectorRegistry()
    types = {Gauge: functools.partial(Gauge, registry=reg), Counter: functools.partial(Counter, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}
    config = vllm_config(model_dir(tmp_path), extra={**FILL, "granularity": "block"})
    KVFillPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})
    labels = {"model_name": "m", "engine": "0", "fill_mode": "normal", "granularity": "block", "backend": "torch",
              "bank": ""}
    assert reg.get_sample_value("vllm:kvfill_config_info", labels) == 1.0


def test_a_grant_dropped_for_routed_experts_is_logged_once(tmp_path, monkeypatch):
    from vllm_harness import model_dir, vllm_config

    from kvfill.connector import scheduler as S
    from kvfill.connector.options import FillOptions

    config = vllm_config(model_dir(tmp_path), extra=FILL)
    config.aux_output_config.enable_return_routed_experts = True
    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)
    sched = S.KVFillScheduler(config, h.kv_cache_config, FillOptions.from_extra_config(FILL))
    warnings = []
    monkeypatch.setattr(S.logger, "warning", lambda msg, *args: warnings.append(msg % args))
    for rid in ("a", "b"):
        req = SimpleNamespace(request_id=rid, num_tokens=40, num_preemptions=0, prompt_token_ids=list(range(40)))
        assert sched.get_num_new_matched_tokens(req, 0) == (39, False)
        sched.update_state_after_alloc(req, None, 0)  # vLLM kept none of the grant
    assert len(warnings) == 1 and "vLLM dropped the fill of request a (enable_return_routed_experts" in warnings[0]
    assert sched.pending == {}


def test_a_vllm_build_without_cpu_ops_falls_back_to_the_registered_cache(monkeypatch):
    from kvfill.connector import cpu_layout

    ops = cpu_layout.cpu_ops()  # vllm._cpu_ops from vLLM 0.34, vllm._custom_ops before

    def missing(*args, **kwargs):
        raise AttributeError("'_OpNamespace' '_C' object has no attribute 'cpu_attn_reshape_and_cache'")

    cpu_layout.layout_matches.cache_clear()
    monkeypatch.setattr(ops, "cpu_attn_reshape_and_cache", missing)
    try:
        assert cpu_layout.layout_matches("vec", torch.bfloat16, 2, 32, 64) is False
    finally:
        cpu_layout.layout_matches.cache_clear()
