"""kvfill-check ``--in-process --serve`` on a GPU: before each server starts,
the check's process releases its GPU memory (collected engines, torch's
cached blocks), then refuses the served run - one line naming what it holds,
the GPU's total and the utilisation asked - where ``vllm serve`` could not
start beside it; on CPU nothing is released or measured.  torch.cuda's
queries are stood in for: a GPU as the check's process would find it."""
import gc

import pytest
import torch

vllm = pytest.importorskip("vllm")

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


def test_the_server_utilization_is_the_users_flag_else_vllms_default():
    from vllm.engine.arg_utils import EngineArgs

    assert requested_utilization({"gpu_memory_utilization": 0.5}) == 0.5
    assert requested_utilization({"dtype": "float32"}) == EngineArgs.gpu_memory_utilization


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
    got = _served(monkeypatch, tmp_path, True, {})
    assert got == {"error": release_before_serving(requested_utilization({}))}
    assert "this process still holds 30.00 GiB" in got["error"]


def test_an_in_process_served_run_is_weighed_at_the_users_utilization(gpu, monkeypatch, tmp_path):
    with pytest.raises(ServerStarted):  # 0.5 x 140 GiB = 70 GiB asked, 100 free
        _served(monkeypatch, tmp_path, True, {"gpu_memory_utilization": 0.5})
    assert gpu["calls"][:2] == ["gc.collect", "empty_cache"]


def test_a_served_run_in_a_process_of_its_own_starts_its_server_unweighed(gpu, monkeypatch, tmp_path):
    with pytest.raises(ServerStarted):
        _served(monkeypatch, tmp_path, False, {})
    assert gpu["calls"] == []

