"""What ``load_bank`` weighs a bank against on a GPU, read from vLLM's cache
config: vLLM's budget as a fraction of the GPU (the one vLLM's own worker
requests, ``request_memory``, whose default vLLM 0.34 leaves unset until it
resolves it), and under vLLM 0.34's extensible KV cache the bytes of the
registered caches that torch's allocator does not hold."""
import math
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
from vllm.config import CacheConfig  # noqa: E402
from vllm.v1.worker.utils import request_memory  # noqa: E402

from kvfill.connector.bank_checks import server_utilization  # noqa: E402
from kvfill.connector.bank_fit import allocatable, fit_error  # noqa: E402
from kvfill.connector.bank_loading import caches_outside_torch  # noqa: E402

GIB = 2**30
H200 = 143_771 * 2**20
EXTENSIBLE = "enable_extensible_kv_cache" in CacheConfig.__dataclass_fields__  # vLLM 0.34
CONFIGS = [{}, {"gpu_memory_utilization": 0.5}] + (
    [{"enable_extensible_kv_cache": True}, {"enable_extensible_kv_cache": True, "gpu_memory_utilization": 0.8},
     {"enable_extensible_kv_cache": False}] if EXTENSIBLE else [])


@pytest.mark.parametrize("flags", CONFIGS, ids=str)
def test_the_budget_weighed_is_the_one_vllms_worker_requests(flags, vllm_cpu_platform):
    cache = CacheConfig(**flags)
    snapshot = SimpleNamespace(total_memory=H200, free_memory=H200, device_="cuda:0")
    assert math.ceil(H200 * server_utilization(cache)) == request_memory(snapshot, cache)


def test_the_cache_outside_torch_is_the_committed_allocation_counted_once():
    """Under the extensible KV cache every device tensor of the connector's
    kv_cache_config names the one committed allocation (vLLM 0.34's
    ``committed_kv_cache_tensors``); host-resident ones are not on the GPU."""
    def tensor(size, host=False):
        return SimpleNamespace(size=size, layers=["x"], host_resident=host)

    kv = SimpleNamespace(kv_cache_tensors=[tensor(3 * GIB), tensor(3 * GIB), tensor(5 * GIB, host=True)])

    def config(**flags):
        return SimpleNamespace(cache_config=CacheConfig(**flags))

    if EXTENSIBLE:
        assert caches_outside_torch(config(enable_extensible_kv_cache=True), kv) == 3 * GIB
        assert caches_outside_torch(config(enable_extensible_kv_cache=False), kv) == 0
    assert caches_outside_torch(config(), kv) == 0  # unresolved (0.34) or no such cache (0.32): torch's


@pytest.mark.skipif(not EXTENSIBLE, reason="vLLM 0.32 has no extensible KV cache (0.34 has)")
@pytest.mark.parametrize("utilization", [None, 0.95, 0.9, 0.8])
def test_a_bank_accepted_beside_vllms_own_extensible_sizing_leaves_its_peak_its_margin_and_torch_room(
        utilization, vllm_cpu_platform):
    """vLLM 0.34's own sizing (``measure_kv_cache_bytes``, then torch capped
    at what it holds plus what stays free less its non-torch reserve): the
    largest bank ``fit_error`` accepts leaves vLLM its transient peak and its
    margin free, and torch room to grow by the peak; at the default
    utilization (1.0) no bank fits."""
    from vllm.v1.worker import extensible_kv_cache as ext

    total, baseline, non_kv, peak = H200, 3 * GIB // 2, 18 * GIB, 4 * GIB  # weights + graphs held by torch
    u = server_utilization(CacheConfig(enable_extensible_kv_cache=True, gpu_memory_utilization=utilization))
    init_free = total - baseline
    kv = ext.measure_kv_cache_bytes(init_free_memory=init_free, free_memory=init_free - non_kv, committed_bytes=0,
                                    requested_memory=math.ceil(total * u), transient_peak_bytes=peak)
    free = init_free - non_kv - kv
    cap = non_kv + free - ext.KV_CACHE_NON_TORCH_RESERVE_BYTES
    gpu = dict(free=free, torch_free=allocatable(free, total, non_kv, cap / total), total=total, held=non_kv + kv,
               utilization=u, kv_cache_memory_bytes=None, extensible=True)
    lo, hi = 0, free + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fit_error(mid, **gpu) is None else (lo, mid)
    kept = max(ext.KV_CACHE_MARGIN_FLOOR_BYTES, int(peak * ext.KV_CACHE_MARGIN_FRACTION))
    assert free - lo >= peak + kept and cap - non_kv - lo >= peak
    assert (lo == 0) == (utilization is None), lo
