"""``kvfill-check --also-replay`` (check/replays.py): replay again beside
``replay`` with its own bank, bank_placement or past_bank, each run judged
against the one real prefill; malformed values and banks that cannot replay
into the model are refused before anything runs, naming the run."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from kvfill.check import runner  # noqa: E402
from kvfill.check.cli import CheckError, check_config  # noqa: E402
from kvfill.check.compare import compare_all  # noqa: E402
from kvfill.check.inputs import Inputs, prepare  # noqa: E402
from kvfill.check.verdict import verdicts  # noqa: E402
from kvfill.kernels import Bank  # noqa: E402


@pytest.fixture(autouse=True)
def _vllm_platform(vllm_cpu_platform):
    """conftest's vllm_cpu_platform for every test here (vLLM 0.34's CUDA wheel resolves no platform alone)."""


def _bank(path, kv=(2, 16, 16)) -> str:
    """A bank of the tiny Llama's two attention layers (``kv`` their K/V geometry), 7 positions."""
    width = kv[0] * (kv[1] + kv[2])
    layers = {f"model.layers.{i}.self_attn.attn": torch.randn(7, width).to(torch.bfloat16) for i in range(2)}
    Bank(layers, sequence_lengths=[3, 4], sequence_tokens=[[5, 6, 7], [8, 9, 10, 11]],
         kv={n: kv for n in layers}).save(str(path))
    return str(path)


@pytest.mark.parametrize("value, says", [
    ("host:bank_placement=host", "expected NAME:KEY=VALUE[,KEY=VALUE...] with NAME replay-<"),
    ("replay-host", "expected NAME:KEY=VALUE"),
    ("replay-Host:bank_placement=host", "expected NAME:KEY=VALUE"),
    ("replay-host:placement=host", "'placement=host' is not a setting; expected KEY=VALUE with KEY one of "
                                   "['bank', 'bank_placement', 'past_bank']"),
    ("replay-host:bank_placement=gpu", "bank_placement 'gpu'; expected one of ['auto', 'device', 'host']"),
    ("replay-host:past_bank=rotate,past_bank=wrap", "past_bank is given twice"),
    ("replay-x:bank=", "'bank=' is not a setting"),
])
def test_a_malformed_value_is_refused_naming_it(check_model, value, says):
    model, prompts = check_model
    with pytest.raises(CheckError, match="--also-replay") as err:
        check_config(["--model", model, "--prompts", prompts, "--also-replay", value])
    assert f"--also-replay {value!r}: " in str(err.value) and says in str(err.value), str(err.value)


def test_a_run_named_twice_or_a_missing_bank_is_refused(check_model, tmp_path):
    model, prompts = check_model
    with pytest.raises(CheckError, match="replay-a is named twice"):
        check_config(["--model", model, "--prompts", prompts, "--also-replay", "replay-a:past_bank=rotate",
                      "replay-a:bank_placement=host"])
    with pytest.raises(CheckError, match=r"--also-replay replay-a: bank '.*nothing.safetensors': no such file"):
        check_config(["--model", model, "--prompts", prompts, "--also-replay",
                      f"replay-a:bank={tmp_path / 'nothing.safetensors'}"])


def test_a_runs_bank_that_cannot_replay_into_the_model_is_refused_before_any_step(check_model, tmp_path):
    model, prompts = check_model
    other = _bank(tmp_path / "four-heads.safetensors", kv=(4, 16, 16))
    with pytest.raises(CheckError, match=r"--also-replay replay-other: bank '.*four-heads.safetensors' \(.*\) cannot "
                                         r"replay into --model .*no layer of the bank has the model's K/V geometry"):
        prepare(check_config(["--model", model, "--prompts", prompts, "--also-replay",
                              f"replay-other:bank={other}"]))
    fits = _bank(tmp_path / "fits.safetensors")
    assert prepare(check_config(["--model", model, "--prompts", prompts, "--also-replay",
                                 f"replay-fits:bank={fits}"])).ids


def test_each_run_replays_with_its_own_settings_against_the_one_real_prefill(check_model, tmp_path, monkeypatch):
    """Runs in order after --fills; each replays (the connector's fill_mode)
    with replay's bank and settings but those it names; real prefill runs
    once; each gets its verdict lines and summary, and a run whose tokens
    differ is named so."""
    model, prompts = check_model
    main, half = _bank(tmp_path / "main.safetensors"), _bank(tmp_path / "half.safetensors")
    jobs = {}

    def stand_in(name, job, cfg, i, n, log, env=None):
        jobs[name] = (i, n, job)
        tokens = [5, 6] if name != "replay-half" else [5, 9]  # the half bank's run differs
        return {"run": name, "greedy": [{"tokens": tokens, "logprobs": [-0.5, -0.5]}] * 2, "eos": [],
                "counters": {}, "eos_counters": {}, "timing": {}, "step_s": 1.0}

    monkeypatch.setattr(runner, "step", stand_in)
    cfg = check_config(["--model", model, "--prompts", prompts, "--out", str(tmp_path / "out"), "--bank", main,
                        "--past-bank", "rotate", "--fills", "replay", "zeros", "--max-tokens", "0", "--also-replay",
                        "replay-host:bank_placement=host", f"replay-half:bank={half},past_bank=wrap"])
    # prompts past the banks' sequences (3 and 4 positions): every replay run wraps, each says so its own way
    inputs = Inputs(SimpleNamespace(decode=lambda t: " ".join(map(str, t))), [[5, 6, 7, 1, 2, 3], [8, 9, 10, 11, 4]],
                    40, None)
    res = runner.run_all(cfg, inputs, log=lambda line: None)
    assert [(name, i, n) for name, (i, n, _) in jobs.items()] == [
        ("prefill", 1, 5), ("replay", 2, 5), ("zeros", 3, 5), ("replay-host", 4, 5), ("replay-half", 5, 5)]
    extra = {name: job["connector"]["kv_connector_extra_config"] for name, (_, _, job) in jobs.items() if job["connector"]}
    assert extra["replay"] == {"fill_mode": "replay", "bank": main, "past_bank": "rotate"}
    assert extra["replay-host"] == {"fill_mode": "replay", "bank": main, "bank_placement": "host", "past_bank": "rotate"}
    assert extra["replay-half"] == {"fill_mode": "replay", "bank": os.path.abspath(half)}  # wrap: the default
    assert res["fills"] == extra and json.dumps(res["fills"])
    lines = verdicts(res, compare_all(res))
    assert any(line.startswith("replay-host: greedy tokens = real prefill's") for line in lines), lines
    assert any(line.startswith("replay-half: 2/4 greedy tokens as real prefill's") for line in lines), lines
    assert sum(line.startswith("=> replay-") for line in lines) == 2, lines
    wrapped = {line.split(":", 1)[0]: line for line in lines if "past their recorded sequence's length" in line}
    assert set(wrapped) == {"replay", "replay-host", "replay-half"}, lines
    assert all(("keys re-rotated to position t" in wrapped[r]) == (r != "replay-half") for r in wrapped), wrapped
    assert all(f"=> {r}: not shown valid" in "\n".join(lines) for r in wrapped), lines
