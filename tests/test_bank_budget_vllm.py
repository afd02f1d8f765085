"""What ``load_bank`` weighs a bank against on a GPU, read from vLLM's cache
config: vLLM's budget as a fraction of the GPU (the one vLLM's own worker
requests, ``request_memory``, whose default vLLM 0.34 leaves unset until it
resolves it), and under vLLM 0.34's extensible KV cache the bytes of the
registered caches that torch's allocator does not hold."""
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
from vllm.config import CacheConfig  # noqa: E402
from vllm.v1.worker.utils import request_memory  # noqa: E402

from kvfill.connector.bank_checks import server_utilization  # noqa: E402
from kvfill.connector.bank_loading import caches_outside_torch  # noqa: E402
from kvfill.kernels.registry import RowParts  # noqa: E402

EXTENSIBLE = "enable_extensible_kv_cache" in CacheConfig.__dataclass_fields__  # vLLM 0.34
CONFIGS = [{}, {"gpu_memory_utilization": 0.5}] + (
    [{"enable_extensible_kv_cache": True}, {"enable_extensible_kv_cache": True, "gpu_memory_utilization": 0.8},
     {"enable_extensible_kv_cache": False}] if EXTENSIBLE else [])


@pytest.mark.parametrize("flags", CONFIGS, ids=str)
def test_the_budget_weighed_is_the_one_vllms_worker_requests(flags, vllm_cpu_platform):
    cache = CacheConfig(**flags)
    total = 143_771 * 2**20
    snapshot = SimpleNamespace(total_memory=total, free_memory=total, device_="cuda:0")
    assert math.ceil(total * server_utilization(cache)) == request_memory(snapshot, cache)


def test_the_caches_outside_torch_are_the_extensible_kv_caches_bytes_each_storage_once():
    """Views of one buffer (K and V of a layer, a RowParts) count it once;
    state tensors count; nothing counts where torch holds the caches."""
    buf = torch.empty(4096, dtype=torch.uint8)
    k, v = buf[:1024].view(torch.float16), buf[1024:3072]
    other = torch.empty(100, dtype=torch.float32)
    state = [torch.empty(10, dtype=torch.bfloat16), torch.empty(6, dtype=torch.float32)]
    groups = [{"a": k, "b": RowParts((k, v))}, {"s": other}]

    def config(**flags):
        return SimpleNamespace(cache_config=CacheConfig(**flags))

    if EXTENSIBLE:
        assert caches_outside_torch(config(enable_extensible_kv_cache=True), groups, {"m": state}) == 4096 + 444
        assert caches_outside_torch(config(enable_extensible_kv_cache=False), groups, {"m": state}) == 0
    assert caches_outside_torch(config(), groups, {"m": state}) == 0  # unresolved (0.34) or no such cache (0.32)
