"""kvfill-record's command line takes vLLM's engine flags as ``vllm serve``
does: those recording can honour reach ``record()`` (by name, or in
``llm_kwargs`` under their ``LLM(**kwargs)`` names), those it cannot are
refused before vLLM starts, naming the flag, the value and the reason, with
nothing written.  vLLM never starts here: ``record()`` (or ``_run_vllm``) is
replaced by a stand-in that keeps its arguments."""
import os

import pytest

pytest.importorskip("vllm")

import kvfill.record as recorder  # noqa: E402
from kvfill.bench.models import make_config_only  # noqa: E402
from kvfill.record import RecordError  # noqa: E402
from kvfill.record.__main__ import main  # noqa: E402
from kvfill.record.cli import NAMED  # noqa: E402


@pytest.fixture(autouse=True)
def platform(monkeypatch):
    """vLLM's CPU platform where the installed vLLM resolves none here
    (tests/vllm_platform.py: vLLM 0.34's CUDA wheel), so its flags parse."""
    from vllm_platform import cpu_platform_stand_in

    return cpu_platform_stand_in(monkeypatch)


@pytest.fixture
def out_dir(tmp_path):
    """The folder of --out, empty: what it holds afterwards is what the recorder left."""
    path = tmp_path / "out"
    path.mkdir()
    return path


@pytest.fixture
def base(tmp_path, out_dir):
    """The flags every run needs: --model, --prompts, --out."""
    model = tmp_path / "model"
    model.mkdir()
    prompts = tmp_path / "p.txt"
    prompts.write_text("w3 w4 w5\n")
    return ["--model", str(model), "--prompts", str(prompts), "--out", str(out_dir / "b.safetensors")]


@pytest.fixture
def calls(monkeypatch):
    """``record()`` replaced: each call's keyword arguments, nothing run."""
    seen = []
    monkeypatch.setattr(recorder, "record", lambda **kw: seen.append(kw))
    return seen


def run(argv, calls):
    """main()'s exit code and the one record() call it made (None if none)."""
    rc = main(argv)
    assert len(calls) <= 1
    return rc, (calls[0] if calls else None)


# ------------------------------------------------------------------ refused flags
REFUSED = [
    (["--decode-context-parallel-size", "2"], "--decode-context-parallel-size 2",
     "record a model served with DCP at the same --tensor-parallel-size with --decode-context-parallel-size 1"),
    (["-dcp", "4"], "--decode-context-parallel-size 4", "DCP splits a layer's positions across ranks, not its heads"),
    (["--prefill-context-parallel-size", "2"], "--prefill-context-parallel-size 2", "splits each prompt's positions"),
    (["--data-parallel-size", "2"], "--data-parallel-size 2",
     "data-parallel ranks are separate engines: record with one (--data-parallel-size 1); the bank replays on each"),
    (["--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}'],
     '--kv-transfer-config {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}',
     "the recorder sets its own KV connector"),
    (["--kv-transfer-config.kv_connector", "NixlConnector", "--kv-transfer-config.kv_role", "kv_both"],
     '--kv-transfer-config {"kv_connector": "NixlConnector", "kv_role": "kv_both"}', "its own KV connector"),
    (["--kv-offloading-size", "4"], "--kv-offloading-size 4", "KV offloading is a KV connector of its own"),
    (["--enable-prefix-caching"], "--enable-prefix-caching True", "so every prompt is prefilled for real"),
    (["--enable-chunked-prefill"], "--enable-chunked-prefill True",
     "with chunks, vLLM frees sliding-window blocks behind the window between chunks, before the rows are read"),
    (["--long-prefill-token-threshold", "64"], "--long-prefill-token-threshold 64",
     "splits its prefill into chunks even with chunked prefill off"),
    (["--max-num-scheduled-tokens", "64"], "--max-num-scheduled-tokens 64", "schedules each prompt whole"),
    (["--diffusion-config", '{"canvas_length": 4}'], '--diffusion-config {"canvas_length": 4}',
     "speculative-decoding path"),
    (["--runner", "pooling"], "--runner pooling", "this runner has no generate"),
    (["--convert", "embed"], "--convert embed", "pooling model, which has no generate"),
    (["--tokenizer-mode", "mistral"], "--tokenizer-mode mistral", "the bank keys its rows by those token ids"),
    (["--revision", "v2"], "--revision v2", "pass the folder as --model"),
    (["--tokenizer-revision", "v2"], "--tokenizer-revision v2", "pass the folder as --tokenizer"),
    (["--max-model-len", "auto"], "--max-model-len auto", "give the serving run's number"),
    (["--max-num-batched-tokens", "256", "--max-model-len", "512"], "--max-num-batched-tokens 256",
     "vLLM needs it >= --max-model-len 512"),
]


@pytest.mark.parametrize("flags, named, reason", REFUSED, ids=[" ".join(f[0])[:40] for f in REFUSED])
def test_a_flag_recording_cannot_honour_is_refused_before_vllm_starts(base, out_dir, calls, capsys, flags, named,
                                                                      reason):
    rc, call = run(base + flags, calls)
    err = capsys.readouterr().err
    assert rc == 2 and call is None
    assert "kvfill-record: error: " in err and f"{named}: " in err and reason in err, err
    assert os.listdir(out_dir) == []


def test_every_refused_flag_is_named_in_the_one_error(base, out_dir, calls, capsys):
    rc, call = run(base + ["-dcp", "2", "--enable-prefix-caching", "-dp", "2"], calls)
    err = capsys.readouterr().err
    assert rc == 2 and call is None
    for named in ("--decode-context-parallel-size 2:", "--enable-prefix-caching True:", "--data-parallel-size 2:"):
        assert named in err, err
    assert os.listdir(out_dir) == []


def test_a_refused_flag_in_a_config_file_is_refused_too(base, tmp_path, out_dir, calls, capsys):
    config = tmp_path / "serve.yaml"
    config.write_text("enable-prefix-caching: true\n")
    rc, call = run(base + ["--config", str(config)], calls)
    assert rc == 2 and call is None
    assert "--enable-prefix-caching True: the recorder turns prefix caching off" in capsys.readouterr().err
    assert os.listdir(out_dir) == []


def test_the_recorders_own_off_switches_and_sizes_of_1_are_accepted(base, calls):
    rc, call = run(base + ["--no-enable-prefix-caching", "--no-enable-chunked-prefill", "-dcp", "1", "-dp", "1"],
                   calls)
    assert rc == 0
    assert call["llm_kwargs"] == {"enable_prefix_caching": False, "enable_chunked_prefill": False,
                                  "decode_context_parallel_size": 1, "data_parallel_size": 1}


def test_the_serving_runs_speculative_config_is_passed_to_the_recording(base, calls):
    """The drafter's KV layers are recorded with the target's (docs/replay.md,
    speculative decoding): the flags reach LLM() as vLLM parses them."""
    spec = '{"method": "draft_model", "model": "/d", "num_speculative_tokens": 3}'
    rc, call = run(base + ["--speculative-config", spec], calls)
    assert rc == 0 and call["llm_kwargs"] == {
        "speculative_config": {"method": "draft_model", "model": "/d", "num_speculative_tokens": 3}}
    calls.clear()
    rc, call = run(base + ["--spec-method", "ngram", "--spec-tokens", "3"], calls)
    assert rc == 0 and call["llm_kwargs"] == {"spec_method": "ngram", "spec_tokens": 3}


def test_model_is_required(base, calls, capsys):
    with pytest.raises(SystemExit) as exc:
        main(base[2:])
    assert exc.value.code == 2 and "the following arguments are required: --model" in capsys.readouterr().err
    assert calls == []


# ------------------------------------------------------------------ flags that reach record()
PASSED = [
    (["--tensor-parallel-size", "2"], {}, {"tensor_parallel_size": 2}),
    (["-tp", "2", "--enable-expert-parallel"], {}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}),
    (["--pipeline-parallel-size", "2"], {}, {"pipeline_parallel_size": 2}),
    (["--dtype", "float32"], {"dtype": "float32"}, {}),
    (["--max-model-len", "512"], {"max_model_len": 512}, {}),
    (["--trust-remote-code"], {}, {"trust_remote_code": True}),
    (["--enforce-eager"], {}, {"enforce_eager": True}),
    (["--quantization", "fp8"], {}, {"quantization": "fp8"}),
    (["--max-num-seqs", "4", "--max-num-batched-tokens", "8192"], {},
     {"max_num_seqs": 4, "max_num_batched_tokens": 8192}),
    (["--kv-cache-dtype", "fp8", "--block-size", "32", "--tokenizer", "TOK"],
     {"kv_cache_dtype": "fp8", "block_size": 32, "tokenizer": "TOK"}, {}),
]


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    """Relative names (``TOK``) are folders of the test's own: nothing is
    looked up on the hub, online or not (HF_HUB_OFFLINE=1)."""
    (tmp_path / "TOK").mkdir()
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("flags, named, llm_kwargs", PASSED, ids=[" ".join(f[0])[:40] for f in PASSED])
def test_an_engine_flag_reaches_record_by_name_or_in_llm_kwargs(base, calls, flags, named, llm_kwargs):
    rc, call = run(base + flags, calls)
    assert rc == 0
    assert {k: call[k] for k in NAMED if k in call} == named
    assert call["llm_kwargs"] == llm_kwargs


def test_without_engine_flags_the_recorder_keeps_its_own_settings(base, calls):
    """Only the flags given reach record(): its defaults (and vLLM's) stand."""
    rc, call = run(base, calls)
    assert rc == 0
    assert call == {"model": base[1], "prompts_file": base[3], "out": base[5], "positions": None, "budget_gib": None,
                    "node_wait": 120.0, "node_silence": 10.0, "llm_kwargs": {}}


def test_kvfills_own_flags_are_parsed(base, calls):
    rc, call = run(base + ["--positions", "5", "--budget-gib", "1.5", "--node-wait", "7", "--node-silence", "30"],
                   calls)
    assert rc == 0 and (call["positions"], call["budget_gib"], call["node_wait"], call["node_silence"]) == \
        (5, 1.5, 7.0, 30.0)


def test_a_flag_given_at_vllms_default_still_overrides_the_recorders_setting(base, calls):
    """--no-enforce-eager is EngineArgs' default; given, it still reaches LLM
    (a config file's or an alias's value cannot then override it)."""
    rc, call = run(base + ["--no-enforce-eager"], calls)
    assert rc == 0 and call["llm_kwargs"] == {"enforce_eager": False}


def test_flags_are_spelled_as_vllm_serve_takes_them(base, calls):
    """Underscores for dashes, human-readable numbers, dotted JSON fields."""
    rc, call = run(base + ["--tensor_parallel_size", "2", "--max-model-len", "1k", "-cc.mode", "0"], calls)
    assert rc == 0 and call["max_model_len"] == 1000
    assert call["llm_kwargs"]["tensor_parallel_size"] == 2
    assert int(call["llm_kwargs"]["compilation_config"].mode) == 0


@pytest.mark.parametrize("form", ["--config FILE", "--config=FILE"])
def test_a_config_file_reaches_record_and_the_command_line_wins(base, tmp_path, calls, form):
    config = tmp_path / "serve.yaml"
    config.write_text("tensor-parallel-size: 2\nmax-model-len: 256\nenforce-eager: false\n")
    flag = form.replace("FILE", str(config)).split(" ")
    rc, call = run(base + flag + ["--max-model-len", "512"], calls)
    assert rc == 0 and call["max_model_len"] == 512
    assert call["llm_kwargs"] == {"tensor_parallel_size": 2, "enforce_eager": False}


def test_a_config_file_that_is_not_yaml_is_an_argparse_error(base, tmp_path, calls, capsys):
    config = tmp_path / "serve.json"
    config.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main(base + ["--config", str(config)])
    assert exc.value.code == 2 and "kvfill-record: error: --config: Config file must be of a yaml/yml type" \
        in capsys.readouterr().err


def test_a_dotted_flag_without_its_value_is_an_argparse_error(base, calls, capsys):
    with pytest.raises(SystemExit) as exc:
        main(base + ["--compilation-config.mode"])
    assert exc.value.code == 2 and "--compilation-config.mode: expected one argument" in capsys.readouterr().err


def test_engine_flags_reach_vllm_through_the_recorder(tmp_path, out_dir, monkeypatch, capsys):
    """The real record() up to vLLM: llm_kwargs arrive at _run_vllm, which
    overlays them on the recorder's own LLM settings."""
    model = make_config_only(str(tmp_path / "model"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("w3 w4 w5 w6\n")
    seen = {}

    def stand_in(model, token_ids, work, dtype, kv_cache_dtype, block_size, max_model_len, llm_kwargs, *rest):
        seen.update(dtype=dtype, max_model_len=max_model_len, llm_kwargs=llm_kwargs)
        raise RecordError("the stand-in vLLM stops here")

    monkeypatch.setattr(recorder.recording, "_run_vllm", stand_in)
    rc = main(["--model", str(model), "--prompts", str(prompts), "--out", str(out_dir / "b.safetensors"),
               "-tp", "2", "--dtype", "float32", "--max-model-len", "64", "--trust-remote-code"])
    assert rc == 2 and "the stand-in vLLM stops here" in capsys.readouterr().err
    assert seen == {"dtype": "float32", "max_model_len": 64,
                    "llm_kwargs": {"tensor_parallel_size": 2, "trust_remote_code": True}}
    assert os.listdir(out_dir) == []


# ------------------------------------------------------------------ --help
def test_help_lists_kvfills_flags_and_vllms_engine_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for flag in ("--prompts", "--out", "--positions", "--budget-gib", "--model", "--tensor-parallel-size",
                 "--decode-context-parallel-size", "--kv-cache-dtype"):
        assert flag in out, flag


def test_help_with_a_keyword_shows_the_matching_flags_as_vllm_does(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help=tensor-parallel"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "--tensor-parallel-size" in out and "--prompts" not in out


@pytest.mark.parametrize("offline", ["1", ""])
@pytest.mark.parametrize("flag", ["--tokenizer", "--model"])
def test_a_name_that_cannot_be_resolved_is_one_line_naming_it(base, tmp_path, monkeypatch, capsys, offline, flag):
    """Offline (HF_HUB_OFFLINE=1, an air-gapped cluster) or not, a model or
    tokenizer name that is no folder and not on the hub gives the recorder's
    one-line error, not the hub's traceback; nothing is written."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", bool(offline))
    if not offline:  # no network here: the hub's refusal stands in for "not found"
        from huggingface_hub.errors import RepositoryNotFoundError

        def not_found(*a, **k):
            raise RepositoryNotFoundError("404 Client Error: Repository Not Found for url: https://huggingface.co/...")
        monkeypatch.setattr("huggingface_hub.hf_api.HfApi.snapshot_download", not_found)
        monkeypatch.setattr("huggingface_hub.snapshot_download", not_found)
        monkeypatch.setattr("transformers.utils.hub.cached_files", not_found)
    argv = [*base]
    if flag == "--model":
        argv[1] = "no-such-org/no-such-model"
    else:
        argv += ["--tokenizer", "no-such-org/no-such-tokenizer"]
    (tmp_path / "p.txt").write_text("w3 w4 w5\n")
    rc = main(argv)
    err = capsys.readouterr().err
    name = argv[1] if flag == "--model" else "no-such-org/no-such-tokenizer"
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith(f"kvfill-record: error: {flag} {name!r} cannot be loaded: "
                                                    f"not a folder here and not found"), err
    assert ("HF_HUB_OFFLINE is set" in err) == bool(offline), err
    assert os.listdir(base[5].rsplit("/", 1)[0]) == []


@pytest.mark.parametrize("value", ["1", "true"])
def test_vllms_multiprocess_client_is_refused_at_start_naming_the_variable(base, out_dir, calls, capsys, monkeypatch,
                                                                          value):
    """VLLM_ENABLE_V1_MULTIPROCESSING=1 (vLLM's own default, set explicitly)
    recorded every prompt, then failed fetching the parts (collective_rpc of
    a function, which the multiprocess client does not send) blaming vLLM
    (issue 61, finding 4): now refused before anything runs; 0 is taken."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", value)
    rc, call = run(base, calls)
    err = capsys.readouterr().err
    assert rc == 2 and call is None and os.listdir(out_dir) == []
    assert f"VLLM_ENABLE_V1_MULTIPROCESSING={value!r}: kvfill-record runs vLLM's engine in its own process" in err
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert run(base, calls)[1] is not None
