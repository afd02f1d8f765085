"""Hybrid models on vLLM's CPU engine: a recording keeps each linear layer's
recurrent state (the bank's state section) beside the attention rows, and
replay decodes as real prefill does - gated delta-net (a tiny Qwen3-Next)
and Mamba-2 (a tiny Granite-4-H: the bench), bf16 models."""
import json

import pytest
import torch

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("leaves_nothing")]
vllm = pytest.importorskip("vllm")

STATE_LAYERS = [f"model.layers.{i}.linear_attn" for i in range(3)]


def test_a_gated_delta_net_hybrid_recorded_with_its_state_replays_real_prefill(tmp_path):
    """A tiny Qwen3-Next (3 gated delta-net layers, 1 attention layer, MoE;
    bf16, as vLLM CPU runs gated delta-net) recorded with kvfill-record's
    defaults: each prompt without its last token, its state after the rest
    (conv [3, q+k+v = 1024 channels] and recurrent [4 heads, 128, 128], in
    the dtypes vLLM's engine config picks on this CPU: bf16 conv state, and
    recurrent state in float32 where vLLM CPU's accelerated gated delta-net
    runs (AVX-512 BF16) and bf16 elsewhere).
    Replay's greedy tokens equal real prefill's split as the fill splits it
    (first N - 1 tokens, then the last), every written row and state page
    verified; a synthetic fill (zero state) differs from the first token.
    Mamba-2 (a tiny Granite-4-H) and TP 2: ``bench/hybrid_replay.py``."""
    from kvfill.bank import Bank
    from kvfill.bench import hybrid_replay

    out = tmp_path / "hybrid.json"
    rc = hybrid_replay.main(["--prompt-lens", "48", "80", "--output-len", "5", "--out-dir", str(tmp_path / "run"),
                             "--json", str(out)])
    rows = {r["run"]: r for r in json.loads(out.read_text())["rows"]}
    assert rc == 0, rows
    assert rows["replay vs prefill_split"]["tokens_equal_to_prefill"] == "10/10"
    assert rows["replay vs prefill_split"]["max_abs_logprob_diff"] <= 1e-3
    assert rows["normal"]["per_prompt"] == [0, 0]
    bank = Bank.load(tmp_path / "run" / "bank.safetensors")
    assert bank.lengths == (47, 79) and sorted(bank.states) == STATE_LAYERS
    conv, recurrent = state_dtypes(json.loads(out.read_text())["args"]["model"])
    for name in STATE_LAYERS:
        assert [(tuple(t.shape), t.dtype) for t in bank.states[name]] == [((2, 3, 1024), conv),
                                                                          ((2, 4, 128, 128), recurrent)]


def state_dtypes(model: str) -> tuple[torch.dtype, torch.dtype]:
    """The conv and recurrent state dtypes vLLM picks for ``model`` in bf16 on
    this machine, read from vLLM's own engine config (its CPU platform sets
    the recurrent state's by CPU feature) and state dtype calculator."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    config = EngineArgs(model=model, dtype="bfloat16", skip_tokenizer_init=True).create_engine_config()
    cache = config.cache_config
    return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)
