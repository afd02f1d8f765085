"""Hybrid models on vLLM's CPU engine: a recording keeps each linear layer's
recurrent state (the bank's state section) beside the attention rows, and
replay decodes as real prefill does - gated delta-net (a tiny Qwen3-Next)
and Mamba-2 (a tiny Granite-4-H: the bench), bf16 models."""
import os

import pytest
import torch

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("leaves_nothing")]
vllm = pytest.importorskip("vllm")

from conftest import check_preset  # noqa: E402
from kvfill.connector.states import state_bytes_per_sequence  # noqa: E402  (imports vLLM)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATE_LAYERS = [f"model.layers.{i}.linear_attn" for i in range(3)]


def test_a_gated_delta_net_hybrid_recorded_with_its_state_replays_real_prefill(tmp_path):
    """A tiny Qwen3-Next (3 gated delta-net layers, 1 attention layer, MoE;
    bf16, as vLLM CPU runs gated delta-net) recorded with kvfill-record's
    defaults: each prompt without its last token, its state after the rest
    (conv [3, q+k+v = 1024 channels] and recurrent [4 heads, 128, 128], in
    the dtypes vLLM's engine config picks on this CPU: bf16 conv state, and
    recurrent state in float32 where vLLM CPU's accelerated gated delta-net
    runs (AVX-512 BF16) and bf16 elsewhere).  The prompts are nested, as a
    multi-turn chat's (80 tokens, then its first 49 and its first 48, the
    longest recorded first): each recorded prompt replays its own state, not
    the longer one's that covers as much of it (issue 38; with the old rule
    verify names the requests given sequence 0's state).
    Replay's greedy tokens equal real prefill's split as the fill splits it
    (first N - 1 tokens, then the last), every written row and state page
    verified, each state block's sequence by the rule; a synthetic fill
    (zero state) differs from the first token.
    Model Runner V2 (its real prefill and split the references).
    Mamba-2, fp32 state, prefix caching and TP 2: the ``hybrid`` preset of
    kvfill-check (bench/check_presets.py; docs/replay.md)."""
    from kvfill.bank import Bank

    rc, data, _ = check_preset(tmp_path, ["hybrid", "--nested", "--lens", "80", "49", "48", "--", "--output-len",
                                          "5", "--verify", "--in-process"], runner="v2")
    cmp = data["comparison"]
    assert rc == 0, data["verdicts"]
    assert data["fills"]["replay"]["verify"] == "raise" and "prefill_split" in data["steps"], data["fills"]
    replay = cmp["replay"]["tokens_vs_split"]  # the reference: real prefill split as the fill splits it
    assert (replay["equal"], replay["total"]) == (15, 15) and replay["max_abs_logprob_diff"] <= 1e-3, replay
    assert cmp["normal"]["tokens_vs_split"]["first_divergence"] == [0, 0, 0], cmp["normal"]
    bank = Bank.load(data["bank"])
    assert bank.lengths == (79, 48, 47) and sorted(bank.states) == STATE_LAYERS
    config = engine_config(data["model"])
    conv, recurrent = state_dtypes(config)
    for name in STATE_LAYERS:
        assert [(tuple(t.shape), t.dtype) for t in bank.states[name]] == [((3, 3, 1024), conv),
                                                                          ((3, 4, 128, 128), recurrent)]
    # the recorder's estimate of the state section (vLLM's state shapes) is what was written
    assert state_bytes_per_sequence(config) * 3 == bank.state_bytes


def test_a_short_conv_hybrid_recorded_with_its_state_replays_real_prefills_tokens(tmp_path):
    """A tiny LFM2 (vLLM's SHORT_CONV kind: 3 gated short-conv layers, 1
    attention layer), the other state kind vLLM CPU runs: its conv state
    recorded after all but each prompt's last token, replayed; greedy tokens
    equal real (unsplit) prefill's, a synthetic fill's differ from the
    first. (vLLM CPU's own chunked prefill of this model is not exact, so
    no split reference is asserted: docs/replay.md.)  The V1 model runner,
    vLLM CPU's default (the suite's other hybrids run V2)."""
    from kvfill.bank import Bank

    rc, data, _ = check_preset(tmp_path, ["hybrid", "--kind", "short_conv", "--dtype", "float32", "--lens", "48", "80",
                                          "--", "--output-len", "5", "--split-reference", "off", "--in-process"], runner="v1")
    cmp = data["comparison"]
    assert rc == 0, data["verdicts"]
    assert "prefill_split" not in data["steps"] and cmp["replay"]["tokens"]["identical"], cmp["replay"]
    assert {data["steps"][run]["model_runner"] for run in ("prefill", "replay", "normal")} == {"V1"}
    assert cmp["replay"]["tokens"]["total"] == 10 and cmp["normal"]["tokens"]["first_divergence"] == [0, 0], cmp
    bank = Bank.load(data["bank"])
    assert bank.lengths == (47, 79) and sorted(bank.states) == [f"model.layers.{i}.short_conv" for i in (0, 1, 3)]
    config = engine_config(data["model"], dtype="float32")
    assert state_bytes_per_sequence(config) * 2 == bank.state_bytes  # vLLM's conv state shape, what was written


def test_a_budget_the_state_section_exceeds_is_refused_before_any_worker_starts(tmp_path, monkeypatch):
    """kvfill-record's estimate counts the state section as vLLM will hold it
    (vLLM's state shapes for this engine config): a --budget-gib the
    attention rows fit in but the states do not is refused once vLLM's engine
    config is built, before any worker starts; nothing written."""
    from kvfill.bench.models import word_prompts
    from kvfill.bench.models import make_hybrid_model
    from kvfill.record import RecordError, record, run

    from kvfill.record.inputs import estimate

    model = make_hybrid_model(os.path.join(ROOT, "out", "tiny-hybrid-gdn"), "gdn")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(word_prompts([40, 60], seed=3)) + "\n")
    monkeypatch.setattr(run, "llm_engine", lambda **kw: pytest.fail("a worker started"))
    # the rows and one sequence's state fit, the two sequences' states do not (vLLM picks the state's
    # dtype by CPU feature: float32 on AVX-512 BF16, bf16 elsewhere, so the bytes are read from vLLM)
    budget = (estimate(model, 2, 100, "bfloat16").nbytes + state_bytes_per_sequence(engine_config(model))) / 2**30
    lines = []
    with pytest.raises(RecordError, match="with its recurrent state, over --budget-gib") as err:
        record(model, str(prompts), str(tmp_path / "b.safetensors"), dtype="bfloat16", budget_gib=budget,
               log=lines.append)
    assert "recurrent state" in str(err.value)
    first = next(line for line in lines if line.startswith("bank estimate: "))
    with_states = next(line for line in lines if line.startswith("bank estimate with the state section: "))
    assert "recurrent state" not in first  # the rows' estimate, before vLLM's config is built
    per_sequence = state_bytes_per_sequence(engine_config(model))
    assert f"2 sequences x {per_sequence} B of recurrent state" in with_states, with_states
    assert os.listdir(tmp_path) == ["prompts.txt"]


def test_a_recording_asked_for_mamba_cache_mode_align_runs_mode_none_as_vllm_sets_it():
    """kvfill-record runs without prefix caching, where vLLM sets
    mamba_cache_mode to none whatever the flag says: the recorder's engine
    config (built before any worker starts) runs none, so the recording is
    the one the record role takes (docs/replay.md; issue 38)."""
    from kvfill.bench.models import make_hybrid_model
    from kvfill.record.engine_config import check_engine_config, engine_kwargs

    model = make_hybrid_model(os.path.join(ROOT, "out", "tiny-hybrid-gdn"), "gdn")
    kw = engine_kwargs(model, [[3, 4, 5]], "/nowhere", "bfloat16", "auto", None, 64, {"mamba_cache_mode": "align"},
                       model, cpu=True)
    assert kw["mamba_cache_mode"] == "align" and kw["enable_prefix_caching"] is False
    config = check_engine_config(kw, ["mamba_cache_mode"])
    assert config.cache_config.mamba_cache_mode == "none"


def engine_config(model: str, dtype: str = "bfloat16"):
    """vLLM's engine config for ``model`` (bf16 by default) on this machine
    (its CPU platform picks the recurrent state's dtype by CPU feature)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, dtype=dtype, skip_tokenizer_init=True).create_engine_config()


def state_dtypes(config) -> tuple[torch.dtype, torch.dtype]:
    """The conv and recurrent state dtypes vLLM picks under ``config`` (its
    state dtype calculator)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    cache = config.cache_config
    return MambaStateDtypeCalculator.gated_delta_net_state_dtype(
        config.model_config.dtype, cache.mamba_cache_dtype, cache.mamba_ssm_cache_dtype)

