"""kvfill's warm-up under vLLM 0.34's kernel JIT monitor (issue 59, G5).

vLLM 0.34 arms the monitor at the end of its warm-up; under the extensible
KV cache (CUDA's default) the connector registers the caches after that, in
``extend_kv_cache``, and kvfill's warm-up compiles its kernels there.
``vllm_connector.jit_monitor_allowance`` keeps those compiles from being
reported as "JIT compilation during inference" (raised under
``--jit-monitor-mode error``), and only those.

The tests run against a stand-in built like 0.34's
``vllm/utils/jit_monitor.py`` (module state read at call time, every hook
reporting through ``_handle_jit_event``), and against vLLM's own module
(vLLM 0.32 has it too, armed the same way; it registers the caches before
arming it).  The path through 0.34's own ``extend_kv_cache`` is in
test_vllm034_worker.py."""
import logging
import sys
import threading
import types
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvfill.connector import vllm_connector as vc  # noqa: E402

# What 0.34's monitor does with a Triton compile, cut to the parts the allowance meets
# (vllm/utils/jit_monitor.py: activate, _handle_jit_event, _log_triton_jit_compile,
# _setup_triton_jit_hook's _on_jit_compile): the hook looks its reporter up in the module at call time.
_MONITOR_034 = '''
_active = False
_mode = "warn"
warned = []

def is_active():
    return _active

def activate(*, mode="warn", verbose=False):
    global _active, _mode
    if _active:
        return
    _active, _mode = True, mode

def _handle_jit_event(*, backend, event, fn_name, detail=None):
    message = "%s %s during inference: %s%s. This causes a latency spike" % (backend, event, fn_name, detail or "")
    if _mode == "error":
        raise RuntimeError(message)
    warned.append(message)

def _log_triton_jit_compile(fn_name, kwargs):
    _handle_jit_event(backend="Triton", event="kernel JIT compilation", fn_name=fn_name, detail=None)

def jit_post_compile_hook(**kwargs):  # what activate puts in triton.knobs.runtime.jit_post_compile_hook
    fn = kwargs.get("fn")
    _log_triton_jit_compile(getattr(fn, "name", "<unknown>"), kwargs)
'''


def _compile(monitor, name="_fill_kernel"):
    """What Triton does after compiling a kernel while the monitor is armed."""
    monitor.jit_post_compile_hook(fn=SimpleNamespace(name=name), key=None, compile={})


@pytest.fixture
def monitor(monkeypatch):
    """The stand-in monitor, as ``vllm.utils.jit_monitor`` in sys.modules."""
    module = types.ModuleType(vc.MONITOR_MODULE)
    exec(_MONITOR_034, module.__dict__)
    monkeypatch.setitem(sys.modules, vc.MONITOR_MODULE, module)
    return module


def test_without_a_monitor_the_allowance_changes_nothing_and_imports_nothing(monkeypatch):
    monkeypatch.delitem(sys.modules, vc.MONITOR_MODULE, raising=False)
    with vc.jit_monitor_allowance("registers the KV caches"):
        assert vc.MONITOR_MODULE not in sys.modules  # vLLM imports it to arm it


def test_before_the_monitor_is_armed_nothing_is_wrapped(monitor):
    """The caches registered before vLLM's warm-up ends (extensible KV cache off): nothing to allow."""
    report = monitor._handle_jit_event
    with vc.jit_monitor_allowance("registers the KV caches"):
        assert monitor._handle_jit_event is report


def test_an_armed_monitor_in_error_mode_passes_kvfills_warm_up_and_still_refuses_the_rest(monitor, caplog):
    monitor.activate(mode="error")
    report = monitor._handle_jit_event
    with pytest.raises(RuntimeError, match="kernel JIT compilation during inference: _fill_kernel"):
        _compile(monitor)  # the failure G5 found: a start-up failure under --jit-monitor-mode error
    with caplog.at_level(logging.INFO, logger="vllm.kvfill.connector"):
        with vc.jit_monitor_allowance("registers the KV caches"):
            _compile(monitor, "_fill_kernel")
            _compile(monitor, "_fill_kernel_replay")
    assert "2 kernel compilations of kvfill's warm-up (_fill_kernel, _fill_kernel_replay)" in caplog.text
    assert monitor._handle_jit_event is report  # the monitor as it was
    with pytest.raises(RuntimeError, match="during inference: _late"):
        _compile(monitor, "_late")  # a compile in a step is reported as ever


def test_in_warn_mode_the_warm_up_logs_no_inference_compilation(monitor):
    monitor.activate(mode="warn")
    with vc.jit_monitor_allowance("registers the KV caches"):
        _compile(monitor)
    assert monitor.warned == []
    _compile(monitor, "_late")
    assert len(monitor.warned) == 1 and "_late" in monitor.warned[0]


def test_another_threads_compiles_during_the_allowance_are_reported(monitor):
    """The allowance is kvfill's registration's own (its thread, its task): a
    compile elsewhere in the process at the same time is vLLM's to report."""
    monitor.activate(mode="error")
    seen = []

    def elsewhere():
        try:
            _compile(monitor, "_other")
        except RuntimeError as exc:
            seen.append(str(exc))

    with vc.jit_monitor_allowance("registers the KV caches"):
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
        _compile(monitor)
    assert len(seen) == 1 and "_other" in seen[0]


def test_nested_allowances_restore_the_monitor_once_at_the_end(monitor):
    monitor.activate(mode="error")
    report = monitor._handle_jit_event
    with vc.jit_monitor_allowance("registers the KV caches"):
        with vc.jit_monitor_allowance("writes the startup fill again on wake"):
            _compile(monitor)
        assert monitor._handle_jit_event is not report  # the outer one still holds
        _compile(monitor)
    assert monitor._handle_jit_event is report


def test_an_error_inside_the_allowance_restores_the_monitor(monitor):
    monitor.activate(mode="error")
    report = monitor._handle_jit_event
    with pytest.raises(ValueError, match="bank"):
        with vc.jit_monitor_allowance("registers the KV caches"):
            raise ValueError("bank refused")
    assert monitor._handle_jit_event is report


def test_a_monitor_without_its_reporter_is_named_and_left_alone(monitor, caplog):
    monitor.activate(mode="warn")
    del monitor._handle_jit_event
    with caplog.at_level(logging.WARNING, logger="vllm.kvfill.connector"):
        with vc.jit_monitor_allowance("registers the KV caches (a)"):
            pass
    assert "no _handle_jit_event in this vLLM" in caplog.text


class _Worker:
    """The worker side as the connector drives it: registration compiles the
    engine's kernels (``FillEngine.warmup``), a wake writes the startup fill."""

    def __init__(self, monitor):
        self.monitor, self.calls = monitor, []

    def register_kv_caches(self, kv_caches):
        self.calls.append("register")
        _compile(self.monitor, "_fill_kernel")

    def restore_kv_caches(self):
        self.calls.append("restore")
        _compile(self.monitor, "_fill_kernel")


def test_the_connector_registers_and_restores_inside_the_allowance(monitor):
    """Registration after the monitor is armed (0.34's ``extend_kv_cache``)
    and the startup fill on wake (``restore_kv_caches``)."""
    monitor.activate(mode="error")
    connector = vc.KVFillConnector.__new__(vc.KVFillConnector)  # only the worker side's delegation is driven
    connector.worker = _Worker(monitor)
    connector.register_kv_caches({})
    connector.restore_kv_caches()
    assert connector.worker.calls == ["register", "restore"]
    with pytest.raises(RuntimeError, match="during inference"):
        _compile(monitor, "_step_kernel")


def test_with_vllms_own_monitor_its_triton_hook_passes_the_warm_up(monkeypatch):
    """vLLM's own ``vllm.utils.jit_monitor``: the hook its ``activate``
    installs in Triton (``knobs.runtime.jit_post_compile_hook``), armed in
    error mode, as Triton calls it after a compile."""
    jm = pytest.importorskip(vc.MONITOR_MODULE, reason="this vLLM has no JIT monitor")
    from triton import knobs
    from triton.runtime import jit as triton_jit

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(triton_jit, "serialize_specialization_data", triton_jit.serialize_specialization_data)
    monkeypatch.setattr(jm, "HAS_TRITON", True)  # vLLM's check finds no active driver without a GPU
    monkeypatch.setattr(jm, "_active", True)
    monkeypatch.setattr(jm, "_mode", "error")
    monkeypatch.setattr(jm, "_verbose", False)
    jm._setup_triton_jit_hook()
    hook = knobs.runtime.jit_post_compile_hook
    assert hook is not None
    compiled = dict(fn=SimpleNamespace(name="_fill_kernel"), key=None, repr="", compile={}, is_manual_warmup=False,
                    already_compiled=False)
    with pytest.raises(RuntimeError, match="kernel JIT compilation during inference: _fill_kernel"):
        hook(**compiled)
    report = jm._handle_jit_event
    with vc.jit_monitor_allowance("registers the KV caches"):
        assert hook(**compiled) is None
    assert jm._handle_jit_event is report
    with pytest.raises(RuntimeError, match="during inference"):
        hook(**compiled)
