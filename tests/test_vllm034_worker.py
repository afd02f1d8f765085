"""vLLM 0.34's worker paths that reach the connector outside a step, run
with vLLM 0.34's own functions over the harness's caches (make test-vllm034;
vLLM CPU 0.32 has neither, so these skip there):

* the extensible KV cache: the worker creates the connector in
  ``extend_kv_cache``, after warmup, against the committed pages and a
  config copy holding the committed block count;
* a weight update that borrows the emptied cache's memory
  (``kv_cache_lent_for_weight_update``): the connector is told before the
  pages go (``unregister_kv_caches``) and after they return
  (``restore_kv_caches``), and a startup fill is written again.
"""
import copy
from types import SimpleNamespace

import pytest
import torch

X = pytest.importorskip("vllm.v1.worker.extensible_kv_cache",
                        reason="vLLM 0.34's extensible KV cache is not in this vLLM (make test-vllm034 runs these)")
pytestmark = pytest.mark.needs_vllm

from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402
from vllm_harness import make_harness  # noqa: E402

ATT = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
FILL = {"fill_mean": 0.1, "fill_std": 0.5, "seed": 5, "startup_fill": True}


class _Pages:
    """The extensible cache as the worker sees it: committing pages gives
    back memory whose contents are garbage (poison), releasing drops them."""

    def __init__(self, h, committed: int):
        self.h, self.num_committed_blocks, self.events = h, committed, []
        self.buffer = SimpleNamespace(physical_bytes=h.raw.numel())
        self.physical_bytes = h.raw.numel()
        self.torch_memory_limit = None

    def _garbage(self):
        g = torch.Generator(device="cpu").manual_seed(len(self.events))
        self.h.raw.copy_(torch.randint(0, 256, self.h.raw.shape, dtype=torch.uint8, generator=g,
                                      device="cpu"))

    def commit(self, num_blocks, **kw):
        self.events.append(("commit", num_blocks))
        self._garbage()

    def committed_kv_cache_tensors(self, kv_cache_config, layout, num_blocks):
        return kv_cache_config.kv_cache_tensors

    def committed_views(self, *args):
        return None  # the harness's views are the committed pages already

    def release_physical(self):
        self.events.append(("release",))
        self.buffer.physical_bytes = 0
        self._garbage()

    def recommit(self):
        self.events.append(("recommit",))
        self.buffer.physical_bytes = self.h.raw.numel()
        self._garbage()


def _runner(h, pages):
    """The model runner as ``extend_kv_cache`` reads it, over the harness's caches."""
    return SimpleNamespace(
        extensible_kv_cache=pages, vllm_config=h.config, kv_cache_config=copy.copy(h.kv_cache_config),
        cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: h.layout), kernel_block_sizes=[16],
        compilation_config=SimpleNamespace(static_forward_context={}), kv_caches_by_layer=dict(h.views))


def test_extend_kv_cache_creates_the_connector_after_the_pages_are_committed(tmp_path, monkeypatch):
    from vllm.distributed.kv_transfer import kv_transfer_state

    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)
    # the budget measured after warmup: the harness's views span it (vLLM rebuilds its views over the committed
    # pages of a block-compact layout, the only kind it allows under a connector)
    committed = h.kv_cache_config.num_blocks
    pages = _Pages(h, 2)
    made = []
    monkeypatch.setattr(kv_transfer_state, "_sync_engine_id_across_tp", lambda config: None)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    real_create = kv_transfer_state.KVConnectorFactory.create_connector

    def create(config, role, kv_cache_config):
        made.append((list(pages.events), kv_cache_config.num_blocks))
        return real_create(config=config, role=role, kv_cache_config=kv_cache_config)

    monkeypatch.setattr(kv_transfer_state.KVConnectorFactory, "create_connector", staticmethod(create))
    from kvfill.connector.vllm_connector import KVFillConnector

    real_register = KVFillConnector.register_kv_caches
    monkeypatch.setattr(KVFillConnector, "register_kv_caches",
                        lambda self, caches: pages.events.append(("register",)) or real_register(self, caches))
    runner = _runner(h, pages)
    try:
        X.extend_kv_cache(runner, h.kv_cache_config, committed)
        worker = kv_transfer_state.get_kv_transfer_group()
        # made against the committed block count (vLLM makes it just before the commit: it writes nothing
        # then), its caches registered - the startup fill written - after the commit's fresh pages
        assert made == [([], committed)] and pages.events == [("commit", committed), ("register",)]
        assert worker.worker.facts.kv_cache_config.num_blocks == committed
        engine = worker.worker.engine
        assert engine.verify(engine.whole_plan()).ok
        assert runner.kv_connector.kv_connector is worker
    finally:
        kv_transfer_state.ensure_kv_transfer_shutdown()


def test_a_weight_update_that_borrows_the_cache_writes_the_startup_fill_again(tmp_path, monkeypatch):
    from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: F401  (the module X asks)

    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)
    engine = h.worker.worker.engine
    whole = engine.whole_plan()
    assert engine.verify(whole).ok
    pages = _Pages(h, h.kv_cache_config.num_blocks)
    told = []
    monkeypatch.setattr(X, "has_kv_transfer_group", lambda: True)
    monkeypatch.setattr(X, "get_kv_transfer_group", lambda: h.worker)
    monkeypatch.setattr(h.worker, "unregister_kv_caches",
                        lambda real=h.worker.unregister_kv_caches: told.append("unregister") or real())
    monkeypatch.setattr(X, "max_layer_reload_bytes", lambda model: 1 << 40)  # the update needs the cache's room
    monkeypatch.setattr(X, "device_memory_info", lambda: (0, 1 << 40))
    monkeypatch.setattr(torch.accelerator, "memory_reserved", lambda *a: 0)
    monkeypatch.setattr(torch.accelerator, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda *a: None)
    with X.kv_cache_lent_for_weight_update(pages, torch.nn.Linear(2, 2), reclaimable=True, fail_if_short=True):
        assert pages.events == [("release",)] and told == ["unregister"]
        assert not engine.verify(whole).ok  # the pages are gone with their fill
    assert pages.events == [("release",), ("recommit",)]
    assert h.worker.worker.engine is engine and engine.verify(whole).ok


def test_extend_kv_cache_after_the_jit_monitor_is_armed_passes_kvfills_warm_up(tmp_path, monkeypatch):
    """Issue 59 G5: 0.34 arms its JIT monitor at the end of
    ``compile_or_warm_up_model``, then ``extend_kv_cache`` creates the
    connector, whose registration compiles kvfill's kernels
    (``FillEngine.warmup``).  Under ``--jit-monitor-mode error`` that was a
    start-up failure; the compile is start-up, and a compile in a step is
    still reported.  (Triton interprets here, so the compile is the call
    Triton's post-compile hook makes into the monitor.)"""
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.utils import jit_monitor as jm

    from kvfill.kernels import FillEngine

    h = make_harness(tmp_path, [(LAYERS, FullAttentionSpec(**ATT))], extra=FILL)
    pages = _Pages(h, 2)
    monkeypatch.setattr(kv_transfer_state, "_sync_engine_id_across_tp", lambda config: None)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
    monkeypatch.setattr(jm, "_active", True)  # what activate(mode="error") leaves
    monkeypatch.setattr(jm, "_mode", "error")
    monkeypatch.setattr(jm, "_verbose", False)
    real_warmup = FillEngine.warmup

    def warmup(engine, *a, **k):
        jm._log_triton_jit_compile("_fill_kernel", {})  # Triton's jit_post_compile_hook after a compile
        return real_warmup(engine, *a, **k)

    monkeypatch.setattr(FillEngine, "warmup", warmup)
    with pytest.raises(RuntimeError, match="during inference: _fill_kernel"):
        jm._log_triton_jit_compile("_fill_kernel", {})
    report = jm._handle_jit_event
    try:
        X.extend_kv_cache(_runner(h, pages), h.kv_cache_config, h.kv_cache_config.num_blocks)
        worker = kv_transfer_state.get_kv_transfer_group()
        engine = worker.worker.engine
        assert engine.verify(engine.whole_plan()).ok
        assert jm._handle_jit_event is report
        with pytest.raises(RuntimeError, match="during inference: _step"):
            jm._log_triton_jit_compile("_step", {})
    finally:
        kv_transfer_state.ensure_kv_transfer_shutdown()
