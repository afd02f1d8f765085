"""kvfill-check ``--in-process --serve`` on a GPU: before each server starts,
the check's process releases its GPU memory (collected engines, torch's
cached blocks), then refuses the served run - one line naming what it holds,
the GPU's total and the utilisation asked - where ``vllm serve`` could not
start beside it; on CPU nothing is released or measured.  torch.cuda's
queries are stood in for: a GPU as the check's process would find it."""
import gc
import math

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from kvfill.check import serving  # noqa: E402
from kvfill.check.cli import CheckConfig  # noqa: E402
from kvfill.check.device_memory import release_before_serving, requested_utilization  # noqa: E402

GiB = 2**30


@pytest.fixture
def gpu(monkeypatch):
    """A GPU of ``total`` GiB with ``free`` GiB free after the release, this
    process holding ``held`` GiB in torch's allocator then (before it, also
    ``cached`` GiB of cached blocks); ``calls`` lists the queries in order."""
    state = {"initialized": True, "total": 140, "free": 100, "held": 30, "cached": 12, "calls": []}

    def call(name, result=None):
        def f(*args, **kwargs):
            state["calls"].append(name)
            return result() if result else None
        return f

    def empty_cache():
        state["calls"].append("empty_cache")
        state["cached"] = 0

    monkeypatch.setattr(gc, "collect", call("gc.collect", lambda: 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: state["initialized"])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "memory_reserved",
                        call("memory_reserved", lambda: (state["held"] + state["cached"]) * GiB))
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        call("mem_get_info", lambda: ((state["free"] - state["cached"]) * GiB, state["total"] * GiB)))
    return state


def test_cached_memory_is_released_before_it_is_measured(gpu):
    release_before_serving(0.9)
    assert gpu["calls"] == ["gc.collect", "empty_cache", "memory_reserved", "mem_get_info"]


def test_a_gpu_held_past_the_servers_utilization_refuses_naming_held_total_and_utilization(gpu):
    line = release_before_serving(0.9)  # 0.9 x 140 GiB = 126 GiB asked, 100 free, 30 held here
    assert line is not None and "\n" not in line
    assert "--gpu-memory-utilization 0.9 x 140.00 GiB = 126.00 GiB" in line
    assert "100.00 GiB are free" in line
    assert "this process still holds 30.00 GiB" in line
    assert "drop --in-process" in line
    assert "--gpu-memory-utilization 0.70 or lower" in line  # (100 - 1 GiB for the server's context) / 140


def test_a_gpu_with_room_for_the_server_passes(gpu):
    gpu.update(free=127, held=2)
    assert release_before_serving(0.9) is None
    gpu.update(free=126)  # exactly what vLLM asks: it starts
    assert release_before_serving(0.9) is None


def test_a_lower_utilization_is_suggested_only_where_one_is_left(gpu):
    gpu.update(free=1, held=130)
    line = release_before_serving(0.9)
    assert "drop --in-process" in line and "or lower" not in line


def test_on_cpu_nothing_is_released_or_measured(gpu):
    gpu["initialized"] = False
    assert release_before_serving(0.9) is None
    assert gpu["calls"] == [] and gpu["cached"] == 12


@pytest.fixture(autouse=True)
def _platform(vllm_cpu_platform):
    """The served runs parse vLLM's engine flags: vLLM 0.34's CUDA wheel resolves no platform without a GPU."""


def _starts(engine: dict, free: int, total: int, monkeypatch) -> bool:
    """Whether vLLM's own start-up check (``request_memory``) lets a server
    with these engine flags start on a CUDA GPU with ``free`` bytes free,
    its cache config resolved by vLLM as on CUDA (0.34: whether the KV cache
    is extensible)."""
    from types import SimpleNamespace

    import vllm.platforms as platforms
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.worker.utils import request_memory

    cache = CacheConfig(**{k: v for k, v in engine.items() if k in CacheConfig.__dataclass_fields__})
    if EXTENSIBLE:
        cuda = SimpleNamespace(is_cuda_alike=lambda: True, is_rocm=lambda: False, device_type="cuda")
        monkeypatch.setattr(platforms, "_current_platform", cuda)
        parallel = SimpleNamespace(enable_elastic_ep=bool(engine.get("enable_elastic_ep")))
        VllmConfig._resolve_extensible_kv_cache(SimpleNamespace(cache_config=cache, kv_transfer_config=None,
                                                                parallel_config=parallel))
    try:
        request_memory(SimpleNamespace(total_memory=total, free_memory=free, device_="cuda:0"), cache)
    except ValueError:
        return False
    return True


# vLLM 0.34's extensible KV cache (CUDA's default): a server starts whatever is free; these flags size it otherwise
EXTENSIBLE = "enable_extensible_kv_cache" in EngineArgs.__dataclass_fields__
FIXED = {"enable_extensible_kv_cache": False} if EXTENSIBLE else {}


@pytest.mark.parametrize("engine", [{}, {"gpu_memory_utilization": 0.5}, {"dtype": "float32"},
                                    {"kv_cache_memory_bytes": 8 * GiB}, {"num_gpu_blocks_override": 1000},
                                    {"enable_elastic_ep": True}],
                         ids=["default", "user's", "other flags", "kv bytes", "block count", "elastic EP"])
def test_the_server_utilization_is_where_vllms_own_start_up_check_refuses(engine, monkeypatch):
    """The fraction named is the one below which vLLM's own start-up check
    refuses to start a server with these flags (the user's, else vLLM's
    default); None where that check starts it on any free memory."""
    total = 140 * GiB
    for flags in ([{**engine, **FIXED}, engine] if EXTENSIBLE else [engine]):
        got = requested_utilization(flags)
        if got is None:  # vLLM 0.34's extensible KV cache: the budget is a cap only
            assert EXTENSIBLE and flags.get("enable_extensible_kv_cache") is not False
            assert _starts(flags, GiB, total, monkeypatch)
            continue
        need = math.ceil(total * got)
        assert got == flags.get("gpu_memory_utilization", got) and 0 < got <= 1
        assert _starts(flags, need, total, monkeypatch) and not _starts(flags, need - 1, total, monkeypatch)


class ServerStarted(Exception):
    """The stand-in Server's start: the served run got past the check."""


def _served(monkeypatch, tmp_path, in_process: bool, engine: dict) -> dict:
    def start(*args, **kwargs):
        raise ServerStarted

    monkeypatch.setattr(serving, "Server", start)
    cfg = CheckConfig(model="m", prompts="p.txt", out=str(tmp_path), bank=None, fills=["replay"], output_len=4,
                      max_tokens=8, temperature=0.0, normal=None, constant=0.0, split="off", run_timeout=60,
                      engine=engine, argv=["--model", "m"], in_process=in_process, serve=True)
    run_engine = {"max_model_len": 64, "max_num_seqs": 1, "seed": 0, "enable_prefix_caching": False}
    return serving.served("replay", cfg, run_engine, None, "prompts.jsonl", 1, {}, print)


def test_an_in_process_served_run_is_refused_before_its_server_starts(gpu, monkeypatch, tmp_path):
    got = _served(monkeypatch, tmp_path, True, dict(FIXED))
    assert got == {"error": release_before_serving(requested_utilization(FIXED))}
    assert "this process still holds 30.00 GiB" in got["error"]


def test_an_in_process_served_run_is_weighed_at_the_users_utilization(gpu, monkeypatch, tmp_path):
    with pytest.raises(ServerStarted):  # 0.5 x 140 GiB = 70 GiB asked, 100 free
        _served(monkeypatch, tmp_path, True, {"gpu_memory_utilization": 0.5, **FIXED})
    assert gpu["calls"][:2] == ["gc.collect", "empty_cache"]


@pytest.mark.skipif(not EXTENSIBLE, reason=f"vLLM {vllm.__version__} has no extensible KV cache (0.34 has)")
def test_with_vllms_extensible_kv_cache_an_in_process_served_run_starts_after_releasing(gpu, monkeypatch, tmp_path):
    """vLLM 0.34 starts a server on any free memory (its budget a cap, the
    cache sized after warmup): nothing to refuse, but the release still runs."""
    with pytest.raises(ServerStarted):  # 100 of 140 GiB free: below 0.92 x 140, refused without the extensible cache
        _served(monkeypatch, tmp_path, True, {})
    assert gpu["calls"][:2] == ["gc.collect", "empty_cache"]


def test_a_served_run_in_a_process_of_its_own_starts_its_server_unweighed(gpu, monkeypatch, tmp_path):
    with pytest.raises(ServerStarted):
        _served(monkeypatch, tmp_path, False, {})
    assert gpu["calls"] == []

