"""kvfill-check ``--serve``: each run served by ``vllm serve`` on loopback
and benchmarked by ``vllm bench serve`` (the user's own pair), and the
engine flags a server gets: the user's as typed, the check's own options
left out."""
import json
import os
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.cpu_only

from kvfill.check.cli import CheckError, check_config, serve_argv  # noqa: E402


@pytest.fixture(autouse=True)
def _vllm_platform(monkeypatch):
    """vLLM's CPU platform where the installed vLLM resolves none (its CUDA
    wheel here: make test-vllm034), so its flag parser runs (vllm_platform.py)."""
    from vllm_platform import cpu_platform_stand_in

    cpu_platform_stand_in(monkeypatch)


def test_a_server_gets_the_users_engine_flags_as_typed_and_none_of_the_checks_own():
    argv = ["--model", "m", "--prompts", "p.txt", "--fills", "replay", "normal", "--normal", "-0.5", "2",
            "--serve", "--concurrency=4", "--dtype", "float32", "--max_model_len", "512", "--out", "o",
            "--speculative-config", '{"method": "ngram"}', "--in-process", "--output-len", "3", "-O", "3",
            "--split-reference", "off", "--enforce-eager", "--config=flags.yaml"]
    assert serve_argv(argv) == ["--model", "m", "--dtype", "float32", "--max_model_len", "512",
                                "--speculative-config", '{"method": "ngram"}', "-O", "3", "--enforce-eager",
                                "--config", "flags.yaml"]


def test_a_presets_report_is_named_by_its_variant_and_its_recording_gets_the_engine_flags_only():
    """bench/check_presets.py: check-NAME-cpu.* names the drafter, the
    recording's TP, the runs' TP/PP and --serve; --record-tp's kvfill-record
    gets the preset's engine flags and prompts, not the check's options."""
    import argparse

    from kvfill.bench.check_presets import record_flags, result_name

    def name(preset, extra=(), **kw):
        a = argparse.Namespace(preset=preset, kind="gdn", drafter=None, record_tp=None, record_pp=None,
                               tag=None, serve=False)
        vars(a).update(kw)
        return result_name(a, list(extra))

    assert name("spec", drafter="draft_model") == "spec"
    assert name("spec", drafter="eagle", record_tp=2) == "spec-eagle-rtp2-tp1"
    assert name("spec", ["--tensor-parallel-size", "2"], drafter="mtp", record_tp=2) == "spec-mtp-rtp2-tp2"
    assert name("hybrid", ["--pipeline-parallel-size", "2"], kind="mamba2", serve=True) == "hybrid-mamba2-pp2-serve"
    assert name("llama", record_pp=2) == "llama-rpp2-tp1"
    assert name("llama", ["--pipeline-parallel-size=2"], record_tp=2) == "llama-rtp2-tp1-pp2"
    args = ["--model", "m", "--prompts", "p.txt", "--dtype", "float32", "--output-len", "24", "--max-tokens", "0",
            "--fills", "replay", "normal", "--speculative-config", "{}", "--max-model-len", "468"]
    assert record_flags(args) == ["--model", "m", "--dtype", "float32", "--speculative-config", "{}",
                                  "--max-model-len", "468", "--prompts", "p.txt"]


@pytest.mark.parametrize("flags, named", [
    (["--serve", "--max-tokens", "0"], "--serve with --max-tokens 0"),
    (["--concurrency", "2"], "--concurrency 2: expected an int >= 1, with --serve"),
    (["--serve", "--concurrency", "0"], "--concurrency 0"),
    (["--serve", "--temperature", "0.5"], "--serve with --temperature 0.5"),
    (["--serve", "--conc", "2"], "unrecognized arguments: --conc 2"),
])
def test_serve_options_the_check_cannot_run_with_are_refused_naming_the_value(tmp_path, capsys, flags, named):
    from kvfill.bench.models import make_config_only

    model = make_config_only(str(tmp_path / "model"))
    (tmp_path / "p.txt").write_text("w5 w6\n")
    with pytest.raises((CheckError, SystemExit)) as exc:  # argparse's own errors exit 2
        check_config(["--model", model, "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "o"), *flags])
    assert named in str(exc.value) + capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_failed_served_run_is_reported_and_leaves_the_fills_eos_lengths_unjudged():
    """--serve: a fill whose served run failed, or real prefill's, is named;
    its EOS lengths were not measured, so no fill is called valid on them."""
    from kvfill.check import compare, verdict

    rows = [{"tokens": [1, 2], "logprobs": [-1.0, -1.0]}] * 2
    served = {"request_throughput": 1.0, "mean_tpot_ms": 10.0, "concurrency": 2}
    eos = [{"length": 5, "eos": True}, {"length": 8, "eos": True}]

    def step(run, **kw):
        return {"run": run, "greedy": rows, "eos": [], "counters": {}, "eos_counters": {}, "step_s": 1.0, **kw}

    for failed in ("replay", "prefill"):
        steps = {run: step(run, **({"served_error": "server exited with 1"} if run == failed else
                                   {"eos": eos, "served": served, "texts": ["a", "b"]}))
                 for run in ("prefill", "replay")}
        res = {"steps": steps, "prompt_tokens": [3, 4], "bank_recorded": True, "runtime_s": 1.0, "moe_note": None}
        lines = verdict.verdicts(res, compare.compare_all(res))
        assert f"{failed}: served run failed - server exited with 1" in lines, lines
        assert "=> replay: not shown valid (EOS lengths not measured: a served run failed)" in lines, lines


def test_a_server_completes_a_decoys_token_ids_and_its_prefix_cache_hits_are_read_from_metrics():
    """--serve --decoys: each decoy goes to the server's /v1/completions as
    token ids, one token out, under the name requests give the model; /metrics'
    prefix-cache hits (summed over engines) are among the figures read."""
    import http.server
    import threading

    from kvfill.check.serving import CACHE_HITS, Server, served_name

    bodies = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self._send(json.dumps({"choices": [{"text": "x"}]}))

        def do_GET(self):
            self._send('vllm:prefix_cache_hits_total{engine="0",model_name="m"} 48.0\n'
                       'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 16.0\n'
                       'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 99.0\n')

        def _send(self, text):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(text.encode())

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        server = object.__new__(Server)  # the client side only: no vLLM process
        server.port = httpd.server_address[1]
        from types import SimpleNamespace

        assert served_name(SimpleNamespace(model="org/m", engine={})) == "org/m"
        server.complete(served_name(SimpleNamespace(model="m", engine={"served_model_name": ["chat", "tiny"]})),
                        [5, 6, 7], 10.0)
        assert bodies == [("/v1/completions", {"model": "chat", "prompt": [5, 6, 7], "max_tokens": 1,
                                               "temperature": 0.0})]
        assert server.metrics() == {CACHE_HITS: 64.0}
    finally:
        httpd.shutdown()
        thread.join(timeout=10)


@pytest.mark.xdist_group("e2e")  # beside the leaves_nothing group, which holds most of the suite's engine time
@pytest.mark.usefixtures("leaves_nothing")
def test_served_replay_writes_real_prefills_served_texts_and_the_servers_are_stopped(tmp_path):
    """The tiny Llama (peaked weights), 2 prompts, prefix caching after
    decoys: replay's engine run and its server's texts equal real prefill's;
    the replay server counted kvfill's fills on /metrics and real prefill's
    server none; each server reused the decoys' blocks; each run's client
    figures are in the report; no server is left (leaves_nothing).  Model
    Runner V2 (as vLLM serves on a GPU) in every engine and server."""
    from conftest import assert_runner, runner_env

    from kvfill.bench.models import make_model, make_tokenizer

    model = make_tokenizer(make_model(str(tmp_path / "tiny-llama"), init_std=0.15))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(" ".join(f"w{(7 * i + n) % 997 + 3}" for i in range(n)) for n in (90, 130)) + "\n")
    out = tmp_path / "check"
    env = {**runner_env("v2"), "VLLM_CPU_KVCACHE_SPACE": "1"}
    run = subprocess.run([sys.executable, "-m", "kvfill.check", "--model", model, "--prompts", str(prompts),
                          "--out", str(out), "--dtype", "float32", "--output-len", "4", "--max-tokens", "12",
                          "--fills", "replay", "--serve", "--in-process", "--enable-prefix-caching", "--decoys", "64",
                          "--block-size", "32"],
                         capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert_runner("v2", run.stdout + run.stderr)  # the in-process engines
    for name in ("prefill", "replay"):  # and each server's
        assert_runner("v2", (out / "logs" / f"served-{name}-server.log").read_text())
    data = json.loads((out / "report.json").read_text())
    steps, cmp = data["steps"], data["comparison"]
    assert cmp["replay"]["tokens"]["identical"]
    assert cmp["replay"]["served_vs_real"]["same_text"] == cmp["replay"]["served_vs_real"]["texts"] == 2
    for name in ("prefill", "replay"):
        served = steps[name]["served"]
        assert served["completed"] == 2 and served["failed"] == 0 and served["request_throughput"] > 0, name
        with open(out / "logs" / f"served-{name}.json") as f:  # the client's own file
            lens = json.load(f)["output_lens"]
        assert cmp[name]["eos"]["lengths"] == lens and all(1 <= n <= 12 for n in lens), name
    assert any(v > 0 for v in steps["replay"]["served"]["kvfill"].values()), steps["replay"]["served"]
    assert not any(steps["prefill"]["served"]["kvfill"].values())
    # --decoys: each server completed the decoys first, and each prompt found its first 64 tokens cached there
    assert [steps[name]["served"]["prefix_cache_hit_tokens"] for name in ("prefill", "replay")] == [128, 128], steps
    assert [steps[name]["counters"]["prefix_cache_hit_tokens"] for name in ("prefill", "replay")] == [128, 128], steps
    assert any(line.startswith("replay: served (vllm bench serve, concurrency 2)") and line.endswith("2/2")
               for line in data["verdicts"]), data["verdicts"]
    assert "served req/s" in (out / "report.md").read_text()
