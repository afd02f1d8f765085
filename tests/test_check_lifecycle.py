"""kvfill-check's life cycle on a shared host: each engine's KV space sized
from the prompts (or the user's), a host that cannot hold it refused before
anything is written."""
import pytest

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.cpu_only

from kvfill.check.cli import CheckError, check_config  # noqa: E402

GiB = 2**30


@pytest.fixture(autouse=True)
def _vllm_platform(monkeypatch):
    """vLLM's CPU platform where the installed vLLM resolves none (its CUDA
    wheel here: make test-vllm034), so its flag parser runs (vllm_platform.py)."""
    from vllm_platform import cpu_platform_stand_in

    cpu_platform_stand_in(monkeypatch)


@pytest.fixture
def config_only(tmp_path):
    """A tiny Llama without weights (2 layers, 2 KV heads x 16, bf16: 256 B of KV per token) and one prompt."""
    from kvfill.bench.models import make_config_only

    model = make_config_only(str(tmp_path / "model"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w5 w6 w7\n")
    return model, str(prompts)


def test_the_kv_space_is_sized_from_the_prompts_and_max_model_len_drafter_and_tp_included(config_only, tmp_path):
    """10000 prompts x max_model_len 2000 (16 blocks of 128 = 2048 tokens) x 256 B per token =
    4.883 GiB, x1.25 = 6.1: 7 GiB; decoys double the sequences, TP 2 halves each worker's share, a drafter
    of the same size doubles the bytes per token."""
    from kvfill.check.runner import sized_kv_space

    model, prompts = config_only
    cfg = check_config(["--model", model, "--prompts", prompts, "--out", str(tmp_path / "r")])
    kv = sized_kv_space(cfg, 10000, 2000)
    assert kv["gib"] == 7, kv
    assert kv["source"].startswith("sized from 10000 prompts x max_model_len 2000 (256 B per token over 2 layers, "
                                   "blocks of 128: 4.883 GiB, x1.25 margin"), kv
    assert sized_kv_space(cfg, 2, 40) == {"gib": 1, "source": "sized from 2 prompts x max_model_len 40 (256 B per "
                                          "token over 2 layers, blocks of 128: 0.000 GiB, x1.25 margin, whole GiB)"}
    decoys = check_config(["--model", model, "--prompts", prompts, "--enable-prefix-caching", "--decoys", "1"])
    kv = sized_kv_space(decoys, 10000, 2000)
    assert kv["gib"] == 13 and kv["source"].startswith("sized from 10000 prompts + 10000 decoys x max_model_len 2000")
    tp2 = check_config(["--model", model, "--prompts", prompts, "--tensor-parallel-size", "2"])
    kv = sized_kv_space(tp2, 10000, 2000)  # 2 KV heads over 2 ranks: 2.441 GiB each, x1.25 = 3.05
    assert kv["gib"] == 4 and "; per worker of 2: 2.441 GiB" in kv["source"], kv
    cfg.engine["speculative_config"] = {"method": "draft_model", "model": model, "num_speculative_tokens": 2}
    kv = sized_kv_space(cfg, 10000, 2000)
    assert kv["gib"] == 13 and "(512 B per token over 4 layers, the drafter's 2 included" in kv["source"], kv


def test_the_users_kv_space_is_used_and_one_the_host_cannot_hold_exits_2_before_anything_is_written(
        config_only, tmp_path, monkeypatch, capsys):
    """The host's available memory against the KV space and the weights; nonsense in the variable named."""
    import psutil

    from kvfill.check.__main__ import main
    from kvfill.check.runner import kv_space

    model, prompts = config_only
    cfg = check_config(["--model", model, "--prompts", prompts])
    assert kv_space(cfg, 1, 40)["source"].startswith("sized from 1 prompts")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert kv_space(cfg, 10**6, 10**6) == {"gib": 1, "source": "VLLM_CPU_KVCACHE_SPACE set by the user"}
    huge = int(psutil.virtual_memory().total / GiB) * 4 + 1
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", str(huge))
    out = tmp_path / "report"
    assert main(["--model", model, "--prompts", prompts, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvfill-check: error: this host has ") and "GiB of memory available" in err, err
    assert f"needs about {huge:.1f} GiB (KV space {huge} GiB, VLLM_CPU_KVCACHE_SPACE set by the user" in err, err
    assert "or a smaller VLLM_CPU_KVCACHE_SPACE" in err and not out.exists()
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    assert main(["--model", model, "--prompts", prompts, "--out", str(out)]) == 2
    assert "VLLM_CPU_KVCACHE_SPACE='lots': expected a whole number of GiB >= 1" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(CheckError, match="VLLM_CPU_KVCACHE_SPACE='0'"):
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
        kv_space(cfg, 1, 40)
