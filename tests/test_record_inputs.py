"""The recorder's inputs fail safely: every bad input is a RecordError that
names the value and what was expected, found before vLLM starts, with
nothing written; a bank that cannot be written at the end keeps what the run
recorded; SIGTERM cleans up as Ctrl-C does.  vLLM never starts here:
``_run_vllm`` is replaced by one that writes rows where the worker would."""
import errno
import json
import os
import re
import select
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kvfill.bench.models import make_config_only
from kvfill.kernels import Bank
import kvfill.record as recorder
from kvfill.record import RecordError, estimate
from kvfill.record.__main__ import main

# The recorder parses vLLM's engine flags and tokenizes with transformers (vLLM's):
# skipped where vLLM is not installed (the device image).
pytestmark = pytest.mark.needs_vllm

LAYER = "model.layers.0.self_attn.attn"


@pytest.fixture(autouse=True)
def platform(monkeypatch):
    """True where vLLM's CPU platform stands in for a platform the installed
    vLLM does not resolve here (tests/vllm_platform.py: vLLM 0.34's CUDA wheel)."""
    from vllm_platform import cpu_platform_stand_in

    return cpu_platform_stand_in(monkeypatch)


@pytest.fixture
def model(tmp_path):
    """A tiny Llama's config.json and a word-level tokenizer: all the
    recorder reads before vLLM starts."""
    return make_config_only(str(tmp_path / "model"))


@pytest.fixture
def out_dir(tmp_path):
    """The folder of --out, empty: what it holds afterwards is what the recorder left."""
    path = tmp_path / "out"
    path.mkdir()
    return path


def words(n, start=3):
    return " ".join(f"w{t}" for t in range(start, start + n))  # one token per word


def write_prompts(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def prompts(tmp_path):
    return write_prompts(tmp_path / "p.txt", [words(40), words(30, start=100)])


def write_rows(work, token_ids):
    """A prompt's rows as ``connector/recorder.py`` saves them."""
    from safetensors.torch import save_file

    save_file({LAYER: torch.zeros(len(token_ids), 32, dtype=torch.bfloat16)}, recorder.rows_path(work, token_ids),
              metadata={"value_dtypes": "{}", "layers": json.dumps({LAYER: {"kv": [2, 8, 8], "parts": []}}),
                        "heads": json.dumps({LAYER: [0, 2, 2]}), "tp_rank": "0", "pp_rank": "0",
                        "files_per_prompt": "1"})


def fake_vllm(monkeypatch, during=None):
    """``_run_vllm`` replaced: calls ``during(work)``, then writes every
    prompt's rows; returns the work folders it ran in."""
    runs = []

    def run(model, token_ids, work, *rest):
        runs.append(work)
        if during:
            during(work)
        for t in token_ids:
            write_rows(work, t)
        return {"block_size": "128", "max_model_len": str(max(map(len, token_ids)) + 16), "vllm_version": "fake"}

    monkeypatch.setattr(recorder.recording, "_run_vllm", run)
    return runs


@pytest.fixture
def no_vllm(monkeypatch):
    """vLLM must not start: the input is refused before."""
    monkeypatch.setattr(recorder.recording, "_run_vllm",
                        lambda *a: pytest.fail("vLLM started before the input was refused"))


def test_a_recording_writes_the_bank_and_removes_its_work_folder(model, prompts, out_dir, monkeypatch):
    fake_vllm(monkeypatch)
    bank = recorder.record(model, prompts, str(out_dir / "b.safetensors"), log=lambda msg: None)
    assert os.listdir(out_dir) == ["b.safetensors"]
    assert Bank.load(out_dir / "b.safetensors").num_sequences == bank.num_sequences == 2


# ------------------------------------------------------------------ --out
def test_an_existing_directory_as_out_is_refused_before_vllm_starts(model, prompts, out_dir, no_vllm):
    with pytest.raises(RecordError, match=rf"--out '{re.escape(str(out_dir))}' is a directory; expected the path "
                                          rf"of the bank file"):
        recorder.record(model, prompts, str(out_dir))
    assert os.listdir(out_dir) == []


@pytest.mark.parametrize("flags, expected", [
    ({"node_rank": 1}, r"--node-rank 1 without --nnodes: expected --nnodes N > 1"),
    ({"node_rank": 2, "nnodes": 2}, r"--node-rank 2 with --nnodes 2: expected a node rank below 2"),
])
def test_a_node_rank_outside_a_several_node_recording_is_refused_before_a_worker_starts(
        model, prompts, out_dir, no_vllm, monkeypatch, flags, expected):
    """Without --nnodes a further node's workers would join whatever listens
    at the default master address (issue 38)."""
    monkeypatch.setattr(recorder.recording, "host_workers", lambda *a, **k: pytest.fail("a worker started"))
    with pytest.raises(RecordError, match=expected):
        recorder.record(model, prompts, str(out_dir / "b.safetensors"), llm_kwargs=flags)
    assert os.listdir(out_dir) == []


@pytest.mark.parametrize("wait", [0, -5, float("inf"), float("nan"), "10", True])
def test_a_node_wait_that_is_not_a_positive_number_of_seconds_is_refused(model, prompts, out_dir, no_vllm, wait):
    with pytest.raises(RecordError, match=rf"^--node-wait {re.escape(repr(wait))}: expected a number of seconds > 0"):
        recorder.record(model, prompts, str(out_dir / "b.safetensors"), node_wait=wait,
                        llm_kwargs={"nnodes": 2, "node_rank": 1})
    assert os.listdir(out_dir) == []


@pytest.mark.parametrize("silence", [0, -1, float("inf"), "10"])
def test_a_node_silence_that_is_not_a_positive_number_of_seconds_is_refused(model, prompts, out_dir, no_vllm,
                                                                            silence):
    with pytest.raises(RecordError, match=rf"^--node-silence {re.escape(repr(silence))}: expected a number of "
                                          rf"seconds > 0 \(how long a node may go without a beat"):
        recorder.record(model, prompts, str(out_dir / "b.safetensors"), node_silence=silence,
                        llm_kwargs={"nnodes": 2, "node_rank": 1})
    assert os.listdir(out_dir) == []


def test_a_missing_folder_of_out_is_named_before_vllm_starts(model, prompts, out_dir, no_vllm):
    missing = out_dir / "missing"
    with pytest.raises(RecordError, match=rf"its folder '{re.escape(str(missing))}' does not exist; expected an "
                                          rf"existing folder"):
        recorder.record(model, prompts, str(missing / "b.safetensors"))
    assert os.listdir(out_dir) == []


def test_an_unwritable_folder_of_out_is_refused_before_vllm_starts(model, prompts, out_dir, no_vllm, monkeypatch):
    # os.access stands in for a read-only folder: tests may run as root, whom no mode stops.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: str(p) != str(out_dir) and real_access(p, mode, **kw))
    with pytest.raises(RecordError, match=rf"its folder '{re.escape(str(out_dir))}' is not writable"):
        recorder.record(model, prompts, str(out_dir / "b.safetensors"))
    assert os.listdir(out_dir) == []


def test_the_saved_bank_is_kept_and_named_when_out_cannot_be_written(model, prompts, out_dir, monkeypatch):
    """--out became a directory during the run: the bank saved in the work
    folder stays there, named in the error, instead of the run's rows being lost."""
    out = out_dir / "b.safetensors"
    runs = fake_vllm(monkeypatch, during=lambda work: os.mkdir(out))
    with pytest.raises(RecordError, match=r"--out .* cannot be written .*; the recorded bank is kept at") as exc:
        recorder.record(model, prompts, str(out), log=lambda msg: None)
    kept = os.path.join(runs[0], "bank.safetensors")
    assert repr(kept) in str(exc.value)
    assert Bank.load(kept).num_sequences == 2


def test_the_recorded_rows_are_kept_and_named_when_the_bank_cannot_be_saved(model, prompts, out_dir, monkeypatch):
    def disk_full(self, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    runs = fake_vllm(monkeypatch)
    monkeypatch.setattr(Bank, "save", disk_full)
    with pytest.raises(RecordError, match=r"saving the bank failed \(.*No space left on device\); nothing written") \
            as exc:
        recorder.record(model, prompts, str(out_dir / "b.safetensors"), log=lambda msg: None)
    assert f"the recorded rows are kept in {runs[0]!r}" in str(exc.value)
    assert len([f for f in os.listdir(runs[0]) if f.endswith(".safetensors")]) == 2
    assert not (out_dir / "b.safetensors").exists()


# ------------------------------------------------------------------ other inputs
def test_a_prompts_file_that_is_not_utf8_is_named_with_its_line(model, tmp_path, out_dir, no_vllm):
    path = tmp_path / "p.txt"
    path.write_bytes(words(40).encode() + b"\n\n" + b"w3 \xff w4\n")
    with pytest.raises(RecordError, match=rf"--prompts '{re.escape(str(path))}' is not UTF-8 text: line 3 holds "
                                          rf"bytes that are not UTF-8 \(0xff at file offset \d+\); expected UTF-8 "
                                          rf"text"):
        recorder.record(model, str(path), str(out_dir / "b.safetensors"))
    assert os.listdir(out_dir) == []


def test_a_directory_as_prompts_is_called_a_directory(model, tmp_path, out_dir, no_vllm):
    with pytest.raises(RecordError, match=rf"--prompts '{re.escape(str(tmp_path))}' is a directory; expected a "
                                          rf"text file"):
        recorder.record(model, str(tmp_path), str(out_dir / "b.safetensors"))


def test_a_device_as_prompts_is_called_not_a_regular_file(model, out_dir, no_vllm):
    with pytest.raises(RecordError, match=r"--prompts '/dev/zero' is not a regular file; expected a text file"):
        recorder.record(model, "/dev/zero", str(out_dir / "b.safetensors"))


@pytest.mark.parametrize("budget", ["nan", "inf", "-1", "0"])
def test_a_budget_that_is_nan_infinite_or_not_positive_is_refused(model, prompts, out_dir, no_vllm, capsys, budget):
    rc = main(["--model", model, "--prompts", prompts, "--out", str(out_dir / "b.safetensors"),
               "--budget-gib", budget])
    err = capsys.readouterr().err
    assert rc == 2 and f"--budget-gib {float(budget)} is invalid; expected a finite number of GiB > 0" in err, err
    assert os.listdir(out_dir) == []


def test_positions_beyond_max_model_len_are_refused_before_vllm_starts(model, tmp_path, out_dir, no_vllm):
    prompts = write_prompts(tmp_path / "p.txt", [words(60), words(60, start=100)])
    with pytest.raises(RecordError, match=r"--positions 50 is over --max-model-len 40: vLLM takes prompts of at "
                                          r"most 39 tokens .*; expected --positions <= 39"):
        recorder.record(model, prompts, str(out_dir / "b.safetensors"), positions=50, max_model_len=40)


def test_prompts_longer_than_max_model_len_are_named_by_line_before_vllm_starts(model, tmp_path, out_dir, no_vllm):
    """vLLM refuses a prompt of max_model_len tokens (no room for the token
    it generates): 39 tokens fit --max-model-len 40, 40 do not."""
    prompts = write_prompts(tmp_path / "p.txt", [words(30), "", words(40, start=100), words(39, start=200)])
    with pytest.raises(RecordError, match=r"--max-model-len 40: prompt line\(s\) \[3\] have \[40\] tokens; "
                                          r"vLLM takes at most 39"):
        recorder.record(model, prompts, str(out_dir / "b.safetensors"), max_model_len=40)


def test_positions_cap_each_prompt_and_shorter_prompts_are_recorded_whole():
    """A ragged bank: --positions is a cap, not a length every prompt must reach."""
    assert recorder.choose_positions([[1] * 40, [2] * 17], 30) == [30, 17]
    assert recorder.choose_positions([[1] * 40, [2] * 17], None) == [40, 17]
    for bad in (0, -3, True):
        with pytest.raises(RecordError, match=rf"--positions {bad!r} is invalid; expected an int >= 1"):
            recorder.choose_positions([[1] * 4], bad)


# ------------------------------------------------------------------ SIGTERM
SIGTERM_CHILD = """
import os, sys, time
import kvfill.record as recorder

def run(model, token_ids, work, *rest):
    open(os.path.join(work, "rows.safetensors.part"), "w").close()
    print(work, flush=True)
    time.sleep(120)

recorder.recording._run_vllm = run
recorder.record(sys.argv[1], sys.argv[2], sys.argv[3], log=lambda msg: None)
"""


@pytest.mark.usefixtures("leaves_nothing")
def test_sigterm_during_recording_removes_the_work_folder(model, prompts, out_dir):
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_CHILD, model, prompts, str(out_dir / "b.safetensors")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        work = proc.stdout.readline().strip() if ready else ""
        if not os.path.isdir(work):
            proc.kill()
            pytest.fail(f"the recorder did not start its (fake) vLLM run: {proc.communicate()[1][-2000:]}")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc != 0
    assert not os.path.exists(work) and os.listdir(out_dir) == []


@pytest.fixture
def default_sigterm():
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_the_recorder_handles_sigterm_only_while_it_runs(model, prompts, out_dir, monkeypatch, default_sigterm):
    during = []
    fake_vllm(monkeypatch, during=lambda work: during.append(signal.getsignal(signal.SIGTERM)))
    recorder.record(model, prompts, str(out_dir / "b.safetensors"), log=lambda msg: None)
    assert during[0] not in (signal.SIG_DFL, signal.SIG_IGN, None)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# ------------------------------------------------------------------ provenance
def test_the_bank_names_the_max_model_len_block_size_and_compilation_vllm_ran_with(model, prompts, out_dir, monkeypatch,
                                                                                  platform):
    """Not "auto": the values the engine resolved, read back from it (here a
    stand-in of vLLM's LLM; test_record.py checks the real one)."""
    vllm = pytest.importorskip("vllm")
    from vllm_platform import skip_without_engine_config

    skip_without_engine_config(platform)

    class EngineStandIn:
        def __init__(self, **kw):
            self.kw = kw
            self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(
                cache_config=SimpleNamespace(block_size=128),
                model_config=SimpleNamespace(max_model_len=kw["max_model_len"]),
                compilation_config=SimpleNamespace(mode=2, backend="inductor", custom_ops=["none"])))

        def generate(self, prompts, params, use_tqdm):
            extra = self.kw["kv_transfer_config"]["kv_connector_extra_config"]
            for p in prompts:
                write_rows(extra["record_dir"], p["prompt_token_ids"])

        def collective_rpc(self, fn, args=()):  # no worker process here: nothing left to fetch
            return [fn(None, *args)]

    monkeypatch.setattr(vllm, "LLM", EngineStandIn)
    bank = recorder.record(model, prompts, str(out_dir / "b.safetensors"), log=lambda msg: None)
    assert (bank.metadata["max_model_len"], bank.metadata["block_size"]) == ("56", "128")  # the longest prompt + 16
    assert bank.metadata["compilation"] == "mode=DYNAMO_TRACE_ONCE backend=inductor custom_ops=none"


def test_the_compilation_in_a_banks_provenance_is_vllms_resolved_mode_backend_and_custom_ops(model, tmp_path, platform):
    """Read from vLLM's engine config as the recorder and the serving engine
    build it: eager and vLLM's default (compiled) name different numerics."""
    from vllm_platform import skip_without_engine_config

    skip_without_engine_config(platform)
    from kvfill.connector.bank_checks import compilation_of
    from kvfill.record.engine_config import check_engine_config, engine_kwargs

    def config(flags):
        return check_engine_config(engine_kwargs(model, [[1, 2]], str(tmp_path), "float32", "auto", None, 64, flags,
                                                 model, cpu=True), [])

    eager, compiled = compilation_of(config({"enforce_eager": True})), compilation_of(config({}))
    assert eager.startswith("mode=NONE custom_ops=") and "backend" not in eager
    cc = config({}).compilation_config
    assert compiled == f"mode={type(cc.mode)(cc.mode).name} backend={cc.backend} custom_ops={','.join(cc.custom_ops)}"
    assert int(cc.mode) != 0 and compiled != eager


def test_a_serving_engine_in_another_compilation_mode_than_the_recordings_says_so_when_it_loads_the_bank(
        model, tmp_path, platform):
    """The bank's provenance against the serving engine's own config
    (``load_bank``): recorded eager, served compiled - one warning naming
    both; served eager - none."""
    from vllm_platform import skip_without_engine_config

    skip_without_engine_config(platform)
    from conftest import connector_lines

    from kvfill.bank import BankPart
    from kvfill.connector.bank_checks import compilation_of, load_bank
    from kvfill.record.engine_config import check_engine_config, engine_kwargs

    def config(flags):
        return check_engine_config(engine_kwargs(model, [[1, 2]], str(tmp_path), "float32", "auto", None, 64, flags,
                                                 model, cpu=True), [])

    eager = config({"enforce_eager": True})
    path = tmp_path / "b.safetensors"
    Bank({LAYER: torch.zeros(4, 32, device="cpu")}, sequence_lengths=[4],
         metadata={"compilation": compilation_of(eager)}).save(path)
    for served in (eager, config({})):
        with connector_lines() as said:
            load_bank(str(path), BankPart(0, 1, frozenset([LAYER])), served, torch.device("cpu"))
        lines = [line for line in said if "compilation=" in line]
        if served is eager:
            assert lines == [], said
        else:
            assert lines == [f"KVFillConnector: the bank was recorded with compilation={compilation_of(eager)!r}"
                              f", this run has compilation={compilation_of(served)!r}: replayed rows are real KV "
                              f"but not bit-identical to this run's prefill (eager and compiled kernels round "
                              f"differently; kvfill-record runs as vLLM's defaults compile, and eager with "
                              f"--enforce-eager: record with this run's compilation flags)"], said


# ------------------------------------------------------------------ estimate
def write_config(path, config):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_the_estimate_counts_only_the_full_attention_layers_of_a_linear_attention_hybrid(tmp_path):
    """Qwen3-Next: 3 of every 4 layers are linear attention (recurrent state,
    not in a bank)."""
    types = ["linear_attention"] * 3 + ["full_attention"]
    model = write_config(tmp_path / "qwen3-next", {
        "model_type": "qwen3_next", "num_hidden_layers": 8, "layer_types": types * 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024, "dtype": "bfloat16"})
    est = estimate(model, 3, 100)
    assert (est.layers, est.bytes_per_token) == (2, 2 * (2 * 2 * 16) * 2)  # layers x K+V row x bf16


def test_the_estimate_counts_sliding_and_full_attention_layers(tmp_path):
    model = write_config(tmp_path / "gemma3", {
        "model_type": "gemma3_text", "num_hidden_layers": 6, "sliding_window": 256, "hidden_size": 64,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 1024, "dtype": "bfloat16"})
    assert estimate(model, 1, 10).layers == 6


@pytest.mark.parametrize("kv_cache_dtype, row", [("auto", 576 * 2), ("fp8_ds_mla", 512 + 4 * 4 + 64 * 2)])
def test_the_estimate_of_a_sparse_attention_model_counts_its_latent_rows_as_stored_and_the_indexers(
        tmp_path, kv_cache_dtype, row):
    """DeepSeek-V3.2 / GLM-5 (``index_topk``): per layer the MLA latent row as
    the cache stores it (bf16, or fp8_ds_mla's 656 B) and the indexer's 128
    fp8 key bytes + 4 scale bytes, all of which the recorder records."""
    model = write_config(tmp_path / "dsa", {
        "model_type": "deepseek_v3", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64,
        "v_head_dim": 64, "q_lora_rank": 32, "index_topk": 512, "index_head_dim": 128, "index_n_heads": 4,
        "vocab_size": 1024, "dtype": "bfloat16"})
    est = estimate(model, 1, 10, kv_cache_dtype=kv_cache_dtype)
    assert (est.layers, est.bytes_per_token) == (3, 3 * (row + 132))


# ------------------------------------------------------------------ JSONL prompts
def test_a_jsonl_prompts_file_holds_prompts_with_line_breaks(tmp_path):
    """vLLM's custom dataset format: the same file drives the recorder and
    `vllm bench serve`; a chat template's line breaks survive."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a\nb c", "output_tokens": 3}) + "\n\n" + json.dumps({"prompt": "d"}) + "\n")
    assert recorder.read_prompt_lines(str(path)) == [(1, "a\nb c"), (3, "d")]


@pytest.mark.parametrize("line, message", [
    ("{not json", r"line 2 is not JSON"),
    ('["a"]', r"line 2: expected an object with a non-empty string \"prompt\""),
    ('{"prompt": 7}', r"line 2: expected an object with a non-empty string \"prompt\""),
    ('{"text": "a"}', r"line 2: expected an object with a non-empty string \"prompt\""),
])
def test_a_bad_jsonl_line_is_named_before_vllm_starts(model, tmp_path, out_dir, no_vllm, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "w3 w4 w5"}) + "\n" + line + "\n")
    with pytest.raises(RecordError, match=message):
        recorder.record(model, str(path), str(out_dir / "b.safetensors"))
    assert not os.listdir(out_dir)


def test_positions_cap_the_lengths_checked_against_max_model_len(model, tmp_path, out_dir, monkeypatch):
    """--positions 10 sends 10 tokens of a 100-token prompt: it fits
    --max-model-len 64, and 10 positions are recorded."""
    fake_vllm(monkeypatch)
    prompts = write_prompts(tmp_path / "p.txt", [words(100), words(5, start=200)])
    bank = recorder.record(model, prompts, str(out_dir / "b.safetensors"), positions=10, max_model_len=64,
                           log=lambda msg: None)
    assert bank.lengths == (10, 5)


def test_a_jsonl_prompt_that_tokenizes_to_nothing_is_named_before_vllm_starts(model, tmp_path, out_dir, no_vllm):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": words(5)}) + "\n" + json.dumps({"prompt": "   "}) + "\n")
    with pytest.raises(RecordError, match=r"prompt line\(s\) \[2\] tokenize to no token; expected prompts of at "
                                          r"least one token \(vLLM refuses an empty prompt\)"):
        recorder.record(model, str(path), str(out_dir / "b.safetensors"))
    assert os.listdir(out_dir) == []


def run_lengths(monkeypatch):
    """The max_model_len each (fake) vLLM run was given."""
    seen = []
    fake_vllm(monkeypatch, during=None)
    real = recorder.recording._run_vllm

    def run(model, token_ids, work, dtype, kv_cache_dtype, block_size, max_model_len, *rest):
        seen.append(max_model_len)
        return real(model, token_ids, work, dtype, kv_cache_dtype, block_size, max_model_len, *rest)

    monkeypatch.setattr(recorder.recording, "_run_vllm", run)
    return seen


def test_max_num_batched_tokens_without_max_model_len_caps_the_default_length(model, prompts, out_dir, monkeypatch):
    """The recorder's default max_model_len (longest prompt + 16 = 56 here)
    stays within --max-num-batched-tokens, which vLLM needs without chunked
    prefill; without the flag it is the longest + 16."""
    seen = run_lengths(monkeypatch)
    recorder.record(model, prompts, str(out_dir / "b.safetensors"), llm_kwargs={"max_num_batched_tokens": 48},
                    log=lambda msg: None)
    recorder.record(model, prompts, str(out_dir / "c.safetensors"), log=lambda msg: None)
    assert seen == [48, 56]


def test_max_num_batched_tokens_under_a_prompt_is_refused_naming_the_line(model, tmp_path, out_dir, no_vllm):
    prompts = write_prompts(tmp_path / "p.txt", [words(20), words(63, start=100)])
    with pytest.raises(RecordError, match=r"--max-num-batched-tokens 50: the recorder prefills each prompt whole in "
                                          r"one step \(chunked prefill off\), and prompt line 2 is recorded with 63 "
                                          r"tokens .*; expected --max-num-batched-tokens >= 64, or --positions 49 "
                                          r"or less"):
        recorder.record(model, prompts, str(out_dir / "b.safetensors"), llm_kwargs={"max_num_batched_tokens": 50})


# ------------------------------------------------------------------ signals (record/signals.py)
@pytest.mark.parametrize("signum, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, SystemExit)])
def test_a_signal_vllm_turns_into_its_own_error_is_reported_as_the_signal(signum, raised):
    """Ctrl-C reaches vLLM's workers too, and vLLM's engine then fails with
    its own error (``RuntimeError: cancelled`` from its shared-memory queue):
    the recorder reports the signal (exit 130, or 128 + SIGTERM), with the
    error as its cause; a second signal during the cleanup is ignored; the
    handlers are restored."""
    # the precondition: no handler of the caller's (stop_signals leaves one alone), whatever a test before this one
    # in the same pytest worker left installed
    inherited = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        _signal_into_vllms_error(signum, raised, before)
    finally:
        for s, handler in inherited.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _signal_into_vllms_error(signum, raised, before):
    import time

    from kvfill.record.signals import stop_signals

    with pytest.raises(raised) as exc:
        with stop_signals():
            try:
                os.kill(os.getpid(), signum)
                time.sleep(5)
                pytest.fail("the signal raised nothing")
            except (KeyboardInterrupt, SystemExit):
                os.kill(os.getpid(), signum)  # a second one while cleaning up: ignored
                time.sleep(0.1)
                raise RuntimeError("cancelled")
    assert isinstance(exc.value.__cause__, RuntimeError)
    if raised is SystemExit:
        assert exc.value.code == 128 + signal.SIGTERM
    assert {s: signal.getsignal(s) for s in before} == before


INTERRUPT_CHILD = """
import os, signal, sys, time
# A terminal's foreground process: SIGINT raises (a shell's background job starts with it ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
import kvfill.record as recorder
from kvfill.record.__main__ import main

def run(model, token_ids, work, *rest):
    open(os.path.join(work, "rows.safetensors.part"), "w").close()
    with open(sys.argv[4], "w") as f:  # where the test reads the work folder from
        f.write(work)
    try:
        time.sleep(120)
    except KeyboardInterrupt:  # as vLLM's engine does when its workers died of the same Ctrl-C
        raise RuntimeError("cancelled")

recorder.recording._run_vllm = run
sys.exit(main(["--model", sys.argv[1], "--prompts", sys.argv[2], "--out", sys.argv[3]]))
"""


@pytest.mark.usefixtures("leaves_nothing")
def test_ctrl_c_to_the_process_group_is_interrupted_nothing_written_and_exit_130(model, prompts, out_dir):
    """A terminal's Ctrl-C: SIGINT to the whole process group."""
    import time

    told = out_dir.parent / "work.txt"
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPT_CHILD, model, prompts, str(out_dir / "b.safetensors"),
                             str(told)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not told.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        work = told.read_text() if told.exists() else ""
        if not os.path.isdir(work):
            proc.kill()
            pytest.fail(f"the recorder did not start its (fake) vLLM run: {proc.communicate()[1][-2000:]}")
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "kvfill-record: interrupted; nothing written", err[-2000:]
    assert not os.path.exists(work) and os.listdir(out_dir) == []


def test_the_recorder_compiles_as_vllm_serve_does_and_eager_pipeline_parallelism_is_refused_on_cpu():
    """The recording runs in vLLM's default compilation mode unless told
    (eager and compiled kernels round differently); vLLM CPU's PP fails in
    eager mode whatever the prompts (a later stage never gets its
    intermediate tensors), so an explicit --enforce-eager is refused there
    before vLLM starts."""
    from kvfill.record.engine_config import engine_kwargs

    args = ("m", [[1, 2]], "/w", "auto", "auto", None, 64)
    for parallel in ({"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}, {}):
        for cpu in (True, False):  # vLLM's default: compiled, as vllm serve runs
            assert "enforce_eager" not in engine_kwargs(*args, parallel, "m", cpu=cpu)
    assert engine_kwargs(*args, {"enforce_eager": True}, "m", cpu=True)["enforce_eager"] is True
    with pytest.raises(RecordError, match=r"--enforce-eager with --pipeline-parallel-size 2: vLLM CPU's pipeline "
                                          r"parallelism fails in eager mode"):
        engine_kwargs(*args, {"pipeline_parallel_size": 2, "enforce_eager": True}, "m", cpu=True)


def test_every_node_of_a_recording_derives_one_engine_digest_from_the_same_flags():
    """Node 0 refuses a node whose kvfill-record ran other engine flags
    (``engine_digest``, through the handshake); which node it is, its paths
    and its work folder are its own."""
    from kvfill.record.engine_config import engine_kwargs

    def digest(record_dir="/w", model="m", **flags):
        kw = engine_kwargs(model, [[1, 2]], record_dir, "auto", "auto", None, 64,
                           {"nnodes": 2, "tensor_parallel_size": 2, **flags}, model)
        return kw["kv_transfer_config"]["kv_connector_extra_config"]["record_engine"]

    first = digest(node_rank=0)
    assert first.startswith("sha256:") and digest(node_rank=0) == first
    assert digest("kvfill-record-node1-99", "/other/disk/m", node_rank=1) == first
    assert digest(node_rank=1, max_model_len=128) != first
    assert digest(node_rank=1, dtype="float16") != first
    assert digest(node_rank=1, master_port=29600) != first


def test_a_drafter_is_compared_by_content_not_by_its_path_on_each_node(tmp_path):
    """Issue 38: a byte-identical copy of the drafter at another path on a
    further node was refused as "other engine flags"; another drafter is
    still refused, by the flag it differs in."""
    import shutil

    from kvfill.record.engine_config import engine_flags, engine_kwargs

    drafter = make_config_only(str(tmp_path / "drafter"))
    (tmp_path / "drafter" / "model.safetensors").write_bytes(b"\0" * 64)
    copy = shutil.copytree(drafter, tmp_path / "elsewhere" / "drafter")

    def flags(path, node_rank, tokens=3):
        spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": tokens}
        kw = engine_kwargs("m", [[1, 2]], "/w", "auto", "auto", None, 64,
                           {"nnodes": 2, "node_rank": node_rank, "speculative_config": spec}, "m")
        return kw["kv_transfer_config"]["kv_connector_extra_config"]

    first = flags(drafter, 0)
    assert flags(copy, 1)["record_engine"] == first["record_engine"]
    (tmp_path / "elsewhere" / "drafter" / "model.safetensors").write_bytes(b"\0" * 65)  # another drafter
    other = flags(copy, 1)
    assert other["record_engine"] != first["record_engine"]
    assert {k for k in first["record_flags"] if first["record_flags"][k] != other["record_flags"][k]} == \
        {"speculative_config"}
    assert set(engine_flags({"model": "a", "tokenizer": "b", "node_rank": 1, "dtype": "x"})) == {"dtype"}


def test_record_handshakes_name_each_worker_whose_node_ran_other_flags_and_the_flags():
    from kvfill.connector.metadata import KVFillBankHandshake, KVFillRecordHandshake, check_record_handshakes

    ours = (("dtype", "a1"), ("max_model_len", "b1"), ("seed", "c1"))
    same = KVFillRecordHandshake("a", 0, 0, "sha256:1", ours)
    check_record_handshakes("sha256:1", [same, KVFillBankHandshake("a", 1, 0, "/b", "x"), None], ours)
    theirs = (("dtype", "a1"), ("max_model_len", "b2"), ("enforce_eager", "d1"))
    with pytest.raises(ValueError) as err:
        check_record_handshakes("sha256:1", [same, KVFillRecordHandshake("b", 1, 0, "sha256:2", theirs)], ours)
    text = str(err.value)
    assert "first node runs engine flags sha256:1" in text and "node b, TP rank 1, PP rank 0 runs engine flags " \
           "sha256:2 (differs in --enforce-eager, --max-model-len, --seed)" in text and "node a" not in text, text


def test_the_estimate_counts_the_drafters_kv_layers_a_speculative_recording_records(tmp_path):
    """A draft model's or EAGLE head's layers (its own config), or the
    model's own MTP layers; ngram has no drafter KV."""
    from kvfill.record.inputs import with_drafter

    base = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 1024, "dtype": "bfloat16"}
    target = write_config(tmp_path / "target", {**base, "num_hidden_layers": 4})
    draft = write_config(tmp_path / "draft", {**base, "num_hidden_layers": 2, "num_key_value_heads": 1})
    mtp = write_config(tmp_path / "mtp", {**base, "num_hidden_layers": 4, "num_nextn_predict_layers": 1})
    row = 2 * 2 * 16 * 2  # K+V x 2 heads x 16 x bf16
    est = estimate(target, 3, 100)
    assert (est.layers, est.bytes_per_token) == (4, 4 * row)
    with_draft = with_drafter(est, target, {"method": "draft_model", "model": draft})
    assert (with_draft.layers, with_draft.bytes_per_token) == (6, 4 * row + 2 * (row // 2))
    with_mtp = with_drafter(estimate(mtp, 3, 100), mtp, {"method": "mtp", "num_speculative_tokens": 1})
    assert (with_mtp.layers, with_mtp.bytes_per_token, with_mtp.nbytes) == (5, 5 * row, 100 * 5 * row)
    assert with_drafter(est, target, {"method": "ngram"}) == est
    assert with_drafter(est, target, {"method": "mtp"}) == est  # a model without MTP layers


def test_the_recorders_engine_defaults_leave_the_callers_environment_as_it_was(monkeypatch):
    """run_vllm and host_workers set vLLM's variables they need where unset,
    for their run only: a caller in the same process (kvfill-check
    --in-process, a test) must not read them afterwards as its user's."""
    from kvfill.record import nodes, run
    from kvfill.record.engine import env_defaults

    monkeypatch.delenv("KVFILL_TEST_UNSET", raising=False)
    monkeypatch.setenv("KVFILL_TEST_SET", "the user's")
    seen = {}

    @env_defaults(KVFILL_TEST_UNSET="default", KVFILL_TEST_SET="default")
    def engine_run():
        seen.update(unset=os.environ.get("KVFILL_TEST_UNSET"), set=os.environ.get("KVFILL_TEST_SET"))
        raise RecordError("the run failed")

    with pytest.raises(RecordError):
        engine_run()
    assert seen == {"unset": "default", "set": "the user's"}
    assert "KVFILL_TEST_UNSET" not in os.environ and os.environ["KVFILL_TEST_SET"] == "the user's"
    assert run.run_vllm.__wrapped__ and nodes.host_workers.__wrapped__  # both wear it
