"""The GPU check and the demo stay runnable: dry runs on CPU, with assertions."""
import pytest

from kvfill.bench import engine_demo as demo
from kvfill.bench import fill_bench
from kvfill.gpu import gpu_check
from kvfill.gpu import gpu_check_sections as sections

pytestmark = pytest.mark.cpu_only  # dry runs of the scripts on the CPU


def test_gpu_check_replay_rows_fail_when_the_kernel_replays_nothing(tmp_path, monkeypatch, capsys):
    from kvfill.kernels import triton_fill

    real = triton_fill.launch_fill
    monkeypatch.setattr(triton_fill, "launch_fill",
                        lambda entries, *a, **kw: None if a[5] == "replay" else real(entries, *a, **kw))
    monkeypatch.setattr(sections.LZ, "CASES", sections.LZ.CASES[:2])
    replaying = [s for s in gpu_check.SECTIONS if s[0].startswith(("packed classes", "attention", "offsets"))]
    assert len(replaying) == 3
    monkeypatch.setattr(gpu_check, "SECTIONS", replaying)
    failures = gpu_check.main(["--smoke", "--out", str(tmp_path), "--device", "cpu", "--sizes", "1"])
    out = capsys.readouterr().out
    # u8-packed holds no values (zero mode, never replayed): its two cases still match.
    assert "correctness: constant 20/20, normal 20/20, replay 2/20 cases byte-exact" in out
    assert "MISMATCH std-LBHNC fp32 replay" in out
    assert "packed rows byte-exact: False" in out
    assert "sections: " + "; ".join(f"{name} FAILED" for name, _ in replaying) in out
    assert failures == 18 + 1 + 3  # the 18 cases, the packed-row section and the three sections (their replays)


def test_a_gpu_check_case_that_raises_is_its_own_error_and_the_check_goes_on(tmp_path, monkeypatch, capsys):
    """One raising case (a compile error, out of memory, a CUDA error) is
    reported with its reason; every later case, the performance rows and the
    summary still run, and the exit status counts it."""
    real = sections.check_case
    monkeypatch.setattr(sections.LZ, "CASES", sections.LZ.CASES[:2])

    def check_case(case, dtype, encoding, device, mode):
        if case.name == "std-LBHNC" and dtype == gpu_check.torch.float16 and mode == "normal":
            raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
        return real(case, dtype, encoding, device, mode)

    monkeypatch.setattr(sections, "check_case", check_case)
    monkeypatch.setattr(gpu_check.fill_bench, "run_case", lambda *a, **k: (_ for _ in ()).throw(MemoryError("OOM")))
    monkeypatch.setattr(gpu_check, "check_packed_rows", lambda device, log: [])
    monkeypatch.setattr(gpu_check, "SECTIONS", [("a section that raises", lambda device, log: 1 // 0)])
    failures = gpu_check.main(["--smoke", "--out", str(tmp_path), "--device", "cpu", "--sizes", "1"])
    out = capsys.readouterr().out
    assert "ERROR std-LBHNC fp16 normal: RuntimeError: CUDA error: an illegal memory access was encountered" in out
    assert "correctness: constant 20/20, normal 19/20, replay 20/20 cases byte-exact" in out
    assert "sections: a section that raises FAILED" in out
    assert failures == 1 + 1 + 5  # the case, the section and the five perf runs that raised
    import json

    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["correctness"]["failures"] == 1 and len(report["errors"]) == 7
    assert report["correctness"]["sections"]["a section that raises"]["failed"][0].startswith("raised Zero")
    summary = (tmp_path / "gpu-check-summary.txt").read_text()
    assert "ERRORS (7; each case went on to the next):" in summary and "perf 1 MiB replay: MemoryError: OOM" in summary
    assert "a section that raises: ZeroDivisionError" in summary


def test_gpu_check_replays_canonical_rows_of_a_tp_part_into_vllms_gpu_view(tmp_path):
    """vLLM's per-layer GPU view ``[B, H, N, 2 x head]`` does not name its heads;
    the std-* cases give them, so the device replays TP rank 1's part of a
    canonical bank, permuted into the cache's order at staging."""
    case = next(c for c in sections.LZ.CASES if c.name == "std-LBNHC")
    host = gpu_check.torch.zeros(case.nbytes(2), dtype=gpu_check.torch.uint8)
    engine = sections._engine(case.make(host, gpu_check.torch.bfloat16), case, "auto", "torch", 0.0)
    fmt = engine.row_formats()["layer.0"]
    assert fmt.kv == case.kv and fmt.order is not None and list(fmt.order) != sorted(fmt.order)
    bank = sections.random_bank(engine, gpu_check.torch.bfloat16)
    assert (bank.part.tp_rank, bank.part.tp_size) == (1, 2)
    assert bank.kv["layer.0"] == case.kv  # the rank's heads: half of the canonical bank's


def test_gpu_check_names_what_its_budget_skipped(tmp_path, capsys):
    assert gpu_check.main(["--smoke", "--out", str(tmp_path), "--device", "cpu", "--budget-s", "0"]) == 0
    out = capsys.readouterr().out
    assert "SKIPPED for the budget (0 s): " in out
    assert "correctness std-LBHNC constant (fp32)" in out and "perf 1 MiB replay" in out
    assert "correctness std-LBHNC constant (other dtypes)" in out
    import json

    skipped = json.loads((tmp_path / "gpu_check.json").read_text())["skipped_for_budget"]
    # 4: both CUDA graphs, the packed rows, the device guard; 3: the packed-row, state-page and host-bank timings;
    # 1: the bandwidth figures (gpu/gpu_check_bandwidth.py)
    assert len(skipped) == 13 * 3 + 4 + len(gpu_check.SECTIONS) + 3 + 3 + 2 + 1 + 13 * 3
    # the order a short lease meets them: one dtype of every layout, the GPU-only sections, the other dtypes
    assert skipped.index("CUDA graph capture of fill_blocks") == 13 * 3
    assert skipped.index("perf launch-bound normal") < skipped.index("correctness std-LBHNC constant (other dtypes)")


def test_gpu_check_fails_when_a_perf_row_is_not_verified(tmp_path, monkeypatch, capsys):
    """A fast row whose bytes are wrong is a failure, not a figure."""
    from kvfill.kernels import FillEngine, VerifyReport

    monkeypatch.setattr(FillEngine, "verify", lambda self, plan, **kw: VerifyReport(False, 1, 1, ()))
    monkeypatch.setattr(sections.LZ, "CASES", sections.LZ.CASES[:1])  # the perf rows are what is checked here
    monkeypatch.setattr(gpu_check, "check_packed_rows", lambda device, log: [])
    monkeypatch.setattr(gpu_check, "SECTIONS", ())
    # 5 fill rows, 6 packed-row rows and 3 host-bank rows unverified; the state pages' row checks its pages itself;
    # 3 more: the bandwidth section's two fills and its fill beside a forward ("UNVERIFIED bandwidth row")
    assert gpu_check.main(["--smoke", "--out", str(tmp_path), "--device", "cpu"]) == 17
    out = capsys.readouterr().out
    assert out.count("UNVERIFIED perf row") == 14 and "perf rows verified: 1/15" in out


def test_fill_bench_rows_compare_three_implementations():
    rows = fill_bench.run_case("cpu", fill_bytes=1 << 20, num_layers=2, num_requests=4, mode="normal", repeat=1)
    assert [r["impl"] for r in rows] == ["kvfill", "in-tree", "memset"]
    assert rows[0]["verified"] is True and rows[0]["MiB"] > 0


def test_fill_bench_runs_as_a_script_and_prints_the_normal_fills_value_statistics(capsys):
    """Its command line (a table of the three implementations), and --values:
    the normal fill's mean, std and neighbour correlations at 2^19 samples."""
    rows = fill_bench.main(["--sizes", "1", "--layers", "2", "--requests", "2", "--modes", "constant",
                            "--repeat", "1", "--layout", "LHBNC"])
    assert [r["impl"] for r in rows] == ["kvfill", "in-tree", "memset"] and rows[0]["verified"] is True
    figures = fill_bench.main(["--values", "--tokens", "8192", "--row", "64"])
    assert figures["samples"] == 8192 * 64 and "corr(layer 0, layer 1)" in capsys.readouterr().out
    assert abs(figures["mean"]) < 5 * figures["sampling error of the mean (1/sqrt(n))"]
    assert abs(figures["std"] - 1) < 0.01
    assert max(abs(v) for k, v in figures.items() if k.startswith("corr")) < 0.02, figures


def test_demo_small_run_verifies(capsys):
    assert demo.main(["--requests", "2", "--prompt-len", "300", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "demo OK" in out and "(x: the in-tree fill's ms / this row's, how many times faster" in out


def ptx_check_rows(call: str) -> list[dict]:
    """Run ``ptx_check.<call>`` in a process without TRITON_INTERPRET (real compiles)."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = f"import json; from kvfill.gpu import ptx_check; print(json.dumps(ptx_check.{call}))"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_compiled_kernel_stores_16_bytes_per_thread():
    """Compile for sm_90 (no GPU needed) and check the stores are vectorised."""
    rows = ptx_check_rows("main([])")
    assert len(rows) == 15
    for row in rows:
        stores = {k: v for k, v in row.items() if k.startswith("st.")}
        assert stores and set(stores) == {"st.v4"}, row
        if row["mode"] in ("normal", "replay"):
            # value-table and bank-row reads vectorised too (the scalar loads are
            # the plan entry and the layer table, once per program)
            assert row.get("ld.v4", 0) >= 4, row


@pytest.mark.needs_vllm
def test_planner_bench_selects_what_the_in_tree_connector_selects(capsys):
    from kvfill.bench import planner_bench

    t_in, t_kv = planner_bench.main(["--requests", "8", "--tokens", "5000", "--repeat", "1"])
    assert t_in > 0 and t_kv > 0
    assert "ratio in-tree / kvfill" in capsys.readouterr().out


@pytest.mark.needs_vllm
@pytest.mark.e2e
def test_main_job_runs_vllm_with_kvfill_by_plugin_name(tmp_path, capsys):
    """The main job end to end on vLLM's CPU engine, small: kvfill (loaded by
    name through the vllm.general_plugins entry point) and the in-tree connector."""
    import json

    from kvfill.bench import e2e

    out = tmp_path / "e2e.json"
    rc = e2e.main(["--requests", "2", "--prompt-len", "600", "--output-len", "3", "--kv-cache-gib", "1",
                   "--model", str(tmp_path / "model"), "--connectors", "NullFillConnector", "KVFillConnector",
                   "KVFillConnector:startup", "DecodeBenchConnector", "none", "--prefill-requests", "1",
                   "--json", str(out)])
    assert rc == 0
    rows = {r["connector"]: r for r in json.loads(out.read_text())["rows"]}
    # The real-prefill row is bounded: measured on 1 request, scaled to 2 and labelled so.
    assert rows["none"]["outputs"] == "1/1 x 3" and rows["none"]["measured"] == "1 of 2, x2"
    assert rows["KVFillConnector"]["measured"] == "all" and rows["none"]["fill_MiB"] == 0
    assert rows["KVFillConnector"]["outputs"] == "2/2 x 3" == rows["NullFillConnector"]["outputs"]
    assert rows["NullFillConnector"]["fill_MiB"] == 0 and rows["KVFillConnector"]["null / this"] > 0
    # kvfill fills the prompt minus the last token; the in-tree fills whole blocks.
    assert 0 < rows["KVFillConnector"]["fill_MiB"] <= rows["DecodeBenchConnector"]["fill_MiB"]
    # its startup fill wrote the whole cache once at start: nothing per request (issue 62's fair baseline)
    assert rows["KVFillConnector:startup"]["fill_MiB"] == 0 and rows["KVFillConnector:startup"]["outputs"] == "2/2 x 3"
    # CPU time beside wall time for the timed parts, and the host's load as each row started
    assert all(r["generate_cpu_s"] > 0 and r["load"] >= 0 for r in rows.values())
    assert rows["KVFillConnector"]["fill_cpu_s"] > 0 and rows["none"]["fill_cpu_s"] == 0
    out = capsys.readouterr().out
    assert "all requests produced their outputs" in out and "host: " in out
    assert "not compared with the documented run" in out  # another workload than the documented one


@pytest.mark.needs_vllm
def test_host_bench_compares_both_connectors_on_a_tiny_step():
    from kvfill.bench import host_bench

    rows = host_bench.main(["--steps", "tiny", "--layers", "2", "--repeat", "1"])
    assert rows[0]["kvfill worker ms"] > 0 and rows[0]["in-tree worker ms"] > 0


def test_report_computes_bandwidth_and_memset_share(tmp_path):
    import json

    from kvfill.bench import report

    def bench(impl, median, calls):
        return {"stats": {"median": median}, "extra_info": {
            "impl": impl, "sweep": "size", "case": "64MiB", "mode": "normal", "bytes": 64 << 20,
            "calls": calls, "device": "cpu", "extra_bytes": None}}

    raw = {"benchmarks": [bench("kvfill", 0.01, 1), bench("in-tree", 0.1, 128), bench("memset", 0.008, 1)],
           "machine_info": {"cpu": {"brand_raw": "test cpu"}}}
    path = tmp_path / "x-raw.json"
    path.write_text(json.dumps(raw))
    rows = report.main([str(path), "--out", str(tmp_path / "x")])
    assert rows[0]["kvfill %memset"] == 80.0 and rows[0]["x in-tree"] == 10.0
    assert rows[0]["kvfill GB/s"] == round((64 << 20) / 0.01 / 1e9, 2)
    assert json.loads((tmp_path / "x.json").read_text())["rows"] == rows


def test_kernel_compiles_for_sm90_for_every_layout_in_the_zoo():
    rows = ptx_check_rows("compile_zoo()")
    assert len(rows) >= 13 * 2 * 3
    assert {r["mode"] for r in rows} == {"constant", "normal", "replay"}
    for row in rows:
        assert any(k.startswith("st.") for k in row), row  # every variant stores


@pytest.mark.needs_vllm
@pytest.mark.e2e
def test_main_job_on_a_hybrid_sliding_window_model(tmp_path):
    """Two KV cache groups in a real vLLM engine: Gemma3 alternating sliding-window
    and full attention; kvfill fills fewer bytes than whole blocks and every
    request completes."""
    import json

    from kvfill.bench import e2e

    out = tmp_path / "e2e.json"
    rc = e2e.main(["--hybrid", "--requests", "2", "--prompt-len", "1200", "--output-len", "3", "--kv-cache-gib", "1",
                   "--model", str(tmp_path / "model"), "--connectors", "KVFillConnector", "--json", str(out)])
    assert rc == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["outputs"] == "2/2 x 3"
    # Full-attention layers hold all 1199 external tokens; sliding-window layers
    # only the blocks of the last 256 tokens (the rest are null blocks).
    per_token_layer = 2 * 8 * 128 * 2
    full_only = 2 * 1199 * 2 * per_token_layer
    assert full_only < row["fill_bytes"] < 2 * full_only


@pytest.mark.needs_vllm
@pytest.mark.e2e
def test_the_long_prompt_bench_records_and_replays_one_prompt_and_writes_its_time_and_peak_memory(tmp_path):
    """bench/long_record.py, small: one prompt recorded by kvfill-check,
    replayed, its greedy tokens real prefill's; the figures file names the
    time, the peak resident memory and the report.  (32000 tokens: 250.6 s,
    3.96 GiB, bench/results/long-record-cpu.json.)"""
    import json

    from kvfill.bench import long_record

    assert long_record.main(["--tokens", "600", "--output-len", "4", "--results", str(tmp_path / "results"),
                             "--work", str(tmp_path / "work")]) == 0
    row = json.loads((tmp_path / "results" / "long-record-cpu.json").read_text())
    assert (row["tokens"], row["rc"], row["replay_tokens"]) == (600, 0, "4/4") and row["seconds"] > 0
    assert row["peak_rss_gib"] > 0.1 and row["report"].endswith("check-llama-long600-cpu.json")
    assert (tmp_path / "results" / "check-llama-long600-cpu.md").read_text().startswith("# kvfill-check")
    with pytest.raises(SystemExit):
        long_record.main(["--tokens", "40000"])  # past the tiny Llama's 32768 positions: refused


def test_the_long_replay_bench_refuses_prompts_past_its_models_positions_before_starting_anything(capsys, tmp_path):
    """bench/long_replay.py (128k-token prompts served; its figures:
    bench/results/long-replay-cpu.json): a prompt the 131072-position model
    cannot hold with its output is refused naming the limit."""
    from kvfill.bench import long_replay

    with pytest.raises(SystemExit) as e:
        long_replay.main(["--input-len", "131060", "--work", str(tmp_path / "work")])
    assert e.value.code == 2 and "--input-len 131060: expected 1 to 131055" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


@pytest.mark.needs_vllm
@pytest.mark.e2e
def test_serving_benchmark_drives_a_real_server_with_vllms_client(tmp_path):
    """bench/serve.py end to end, small: vLLM's OpenAI server with kvfill (by
    plugin name) on loopback, driven by `vllm bench serve`, stopped after; the
    record has the concurrency, no failed request, the figures of each of two
    runs (other prompts: every request filled) and their medians, and
    kvfill's counters were read from the served /metrics."""
    import json
    import statistics

    from kvfill.bench import serve

    rc = serve.main(["--connectors", "kvfill", "--concurrency", "2", "--input-len", "300", "--output-len", "4",
                     "--prompts-per-level", "4", "--repeat", "2", "--kv-cache-gib", "1", "--prefill-probe",
                     "--model", str(tmp_path / "model"), "--out", str(tmp_path), "--log-dir", str(tmp_path / "logs")])
    assert rc == 0
    payload = json.loads((tmp_path / "serve-cpu.json").read_text())
    (rec,) = payload["records"]
    assert (rec["connector"], rec["concurrency"], rec["completed"], rec["failed"]) == ("kvfill", 2, 4, 0)
    assert len(rec["runs"]) == 2 and len(payload["commands"]["kvfill"]) == 3  # the server, two client runs
    assert rec["p50_ttft_ms"] == statistics.median(r["p50_ttft_ms"] for r in rec["runs"])
    assert payload["server_metrics"]["kvfill"]["vllm:kvfill_requests_total"] == 8
    assert payload["server_metrics"]["kvfill"]["vllm:kvfill_bytes_total"] > 0
    assert "--host" in payload["commands"]["kvfill"][0] and "127.0.0.1" in payload["commands"]["kvfill"][0]
    # Issue 61: under the server's prefix cache, a prompt filled and then asked with kvfill_prefill true
    # decodes real prefill's tokens (a cache-salted request's), not the filled blocks' - which differ, so the
    # probe could tell - and a kvfill_prefill of "true" gets HTTP 400 naming it.
    probe = payload["prefill_probe"]["kvfill"]
    assert probe["fill_differs"] and probe["real_is_real"], probe
    assert probe["malformed"]["status"] == 400 and "'true' (str)" in probe["malformed"]["message"], probe


@pytest.mark.needs_vllm
@pytest.mark.needs_vllm
def test_the_serving_sweep_holds_each_connectors_startup_fill_beside_its_per_request_fill():
    """The fair baseline (issue 62): kvfill and the in-tree connector each
    with startup_fill (the whole cache filled once) beside their per-request
    fill, in the default sweep."""
    from kvfill.bench import serve

    extra = {"fill_mean": 0.015, "fill_std": 0.1}
    for name, connector in (("kvfill", "KVFillConnector"), ("in-tree", "DecodeBenchConnector")):
        per_request, startup = serve.kv_transfer_config(name, extra), serve.kv_transfer_config(f"{name}-startup", extra)
        assert per_request["kv_connector"] == startup["kv_connector"] == connector
        assert "startup_fill" not in per_request["kv_connector_extra_config"]
        assert startup["kv_connector_extra_config"] == {**extra, "startup_fill": True}
    assert serve.kv_transfer_config("none", extra) is None
    assert {"kvfill-startup", "in-tree-startup"} <= set(serve.CONNECTORS) - {"replay"}


def test_stopping_a_server_stops_its_whole_process_group(tmp_path):
    """A server whose leader exited (startup failure) may leave children: stop()
    ends the group anyway."""
    import os
    import time

    from kvfill.bench.serve import Server

    server = Server(["bash", "-c", "sleep 300 & echo started; exit 1"], dict(os.environ), str(tmp_path / "s.log"),
                    port=1)
    server.proc.wait(timeout=30)
    time.sleep(0.5)
    os.killpg(server.proc.pid, 0)  # the child `sleep` still holds the group
    server.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.proc.pid, 0)


def test_page_bench_times_verified_fills_beside_a_memset():
    from kvfill.bench import page_bench

    rows = page_bench.main(["--num-blocks", "8", "--planned", "4", "--requests", "2", "--layers", "1", "--repeat", "1"])
    assert [r["impl"] for r in rows] == ["kvfill normal", "kvfill replay", "kvfill normal, no page images",
                                         "kvfill replay, no page images", "kvfill constant", "memset"]
    # (each kvfill row is verified inside page_bench.main; ms and GB/s round to 0.0 for tiny runs)
    assert all(r["ms"] >= 0 and r["GB/s"] >= 0 for r in rows)


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def _venv_extras(has_nvidia: str) -> set[str]:
    """The extras ``make venv`` installs kvfill with on one branch of the
    Makefile (``make -n -B``: the commands, expanded, none run)."""
    import re
    import subprocess

    out = subprocess.run(["make", "-n", "-B", "venv", f"HAS_NVIDIA={has_nvidia}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    (extras,) = re.findall(r"install -e '\.\[([\w,-]+)\]'", out)
    return set(extras.split(","))


@pytest.mark.parametrize("has_nvidia", ["", "1"], ids=["cpu", "gpu"])
def test_make_venv_installs_what_kvfill_checks_picture_needs(has_nvidia):
    """kvfill-check's report.png needs matplotlib (check/report.py draws it,
    and says "no report.png" without): the README's set-up, ``make venv``,
    installs it on the CPU and the GPU branch alike."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = _venv_extras(has_nvidia)
    declared = cfg["options.extras_require"]
    assert extras <= set(declared), extras
    requirements = {line.split(">")[0].split("=")[0].split("<")[0].strip()
                    for extra in extras for line in declared[extra].splitlines() if line.strip()}
    assert "matplotlib" in requirements, (extras, requirements)
    assert ("vllm" in extras) == (has_nvidia == "1")  # the CUDA wheel only where a GPU answers
    assert "import matplotlib" in (ROOT / "check" / "report.py").read_text()  # what the picture imports


def _report(work, root) -> dict[str, str]:
    """A check's report.json and report.md as kvfill-check writes them: paths of the project and its work folder."""
    import json

    report = {"command": ["kvfill-check", "--model", f"{root}/out/tiny-llama", "--out", str(work)],
              "bank": f"{work}/bank.safetensors", "logs": {"prefill": f"{work}/logs/prefill.json"},
              "decode_ms_per_token": 12.84, "elsewhere": f"{root}2/x"}
    return {"json": json.dumps(report, indent=1),
            "md": f"`kvfill-check --model {root}/out/tiny-llama --out {work}`\nreplay: 12.84 ms (logs: {work}/logs).\n"}


def test_a_published_check_report_names_no_absolute_path_of_this_machine(tmp_path):
    """bench/check_presets.py publishes a check's report.json and report.md
    with paths relative to the project, a work folder outside the project
    as <work>; every number as it was, the picture as made."""
    import json

    from kvfill.bench import check_presets

    work, results = tmp_path / "work", tmp_path / "results"
    work.mkdir()
    for ext, text in _report(work, ROOT).items():
        (work / f"report.{ext}").write_text(text)
    (work / "report.png").write_bytes(b"\x89PNG picture")
    check_presets.publish(str(work), str(results), "x")
    published = {ext: (results / f"check-x-cpu.{ext}").read_text() for ext in ("json", "md")}
    inside = {ext: check_presets.without_machine_paths(text, str(ROOT / "out" / "check-x"))
              for ext, text in _report(ROOT / "out" / "check-x", ROOT).items()}
    for texts, named in ((published, "<work>"), (inside, "out/check-x")):
        got = json.loads(texts["json"])
        assert got["command"] == ["kvfill-check", "--model", "out/tiny-llama", "--out", named]
        assert got["bank"] == f"{named}/bank.safetensors" and got["logs"]["prefill"] == f"{named}/logs/prefill.json"
        assert got["decode_ms_per_token"] == 12.84 and got["elsewhere"] == f"{ROOT}2/x"  # another folder, kept
        assert texts["md"] == f"`kvfill-check --model out/tiny-llama --out {named}`\n" \
                              f"replay: 12.84 ms (logs: {named}/logs).\n"
        assert str(tmp_path) not in texts["md"] + texts["json"]
    assert (results / "check-x-cpu.png").read_bytes() == b"\x89PNG picture"


def test_the_committed_reports_name_no_absolute_path():
    """Every report bench/check_presets.py, the demo, the serving benchmark
    and the soak published in bench/results names its files relative to the
    project (bench/common.write_json)."""
    import re

    reports = sorted((ROOT / "bench" / "results").glob("check-*-cpu.*")) + [
        ROOT / "bench/results" / name for name in ("cpu_e2e.json", "serve-cpu.json", "serve-c8-cpu.json",
                                                   "serve-replay-cpu.json", "soak-cpu.json")]
    texts = {p.name: p.read_text() for p in reports if p.suffix in (".json", ".md")}
    assert len(texts) > 40
    absolute = re.compile(r"""(?:^|[\s"'`(=])/(?:work|home|tmp|root|Users|mnt|scratch|var|opt)/""")
    assert {name for name, text in texts.items() if absolute.search(text) or str(ROOT) in text} == set()


def _demo_children(monkeypatch, slower: dict[str, float], load: float):
    """bench/e2e.py's main with its children answering what the documented
    run's did (``slower``: a connector's times multiplied), on a 2-core host
    at a 1-minute ``load``: the parent's table and words, no engine."""
    from kvfill.bench import e2e

    reference = e2e.documented()
    per = {r["connector"]: r for r in reference["rows"]}
    total = reference["args"]["requests"]

    def child_result(cmd, conn):  # a row the documented run lacks answers as its connector's did
        r, k = per.get(conn) or per[conn.partition(":")[0]], slower.get(conn, 1.0)
        share = r["requests"] / total  # the documented row's time is scaled to all requests
        return {"connector": conn, "fill_s": r["fill_s"] * k, "fill_cpu_s": r["fill_s"] * k / 3,
                "fill_bytes": r["fill_bytes"], "startup_s": r["startup_s"], "generate_s": r["generate_s"] * share * k,
                "generate_cpu_s": r["generate_s"] * share * k / 2, "outputs": [reference["args"]["output_len"]] * r["requests"]}

    monkeypatch.setattr(e2e, "child_result", child_result)
    monkeypatch.setattr(e2e, "make_model", lambda path, hybrid: path)
    monkeypatch.setattr(e2e.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(e2e.os, "cpu_count", lambda: 2)
    return e2e


def test_demo_on_a_busy_host_says_its_figures_are_far_from_the_documented_ones_and_why(monkeypatch, capsys, tmp_path):
    """The demo prints CPU time beside wall time, the host's load before,
    per row and after, and - its fill 3x slower than the documented run's on
    a host at load 3 on 2 cores - which figures are far and that the busy
    host is the likely cause."""
    import json

    e2e = _demo_children(monkeypatch, {"KVFillConnector": 3.0}, load=3.0)
    assert e2e.main(["--json", str(tmp_path / "e2e.json")]) == 0
    out = capsys.readouterr().out
    assert "host load now 3.00 on 2 cores" in out  # before each row
    header = next(line for line in out.splitlines() if line.lstrip().startswith("connector"))
    assert header.split() == ["connector", "generate_s", "generate_cpu_s", "fill_s", "fill_cpu_s", "fill_MiB",
                              "outputs", "x", "in-tree", "null", "/", "this", "measured", "load"]
    assert "host: 2 cores; 1-minute load average (os.getloadavg) 3.00 before the demo, 3.00 after it" in out
    doc = {r["connector"]: r for r in e2e.documented()["rows"]}
    kv = doc["KVFillConnector"]
    assert "FAR from the documented run (bench/results/cpu_e2e.json: the table of README.md and docs/performance.md)" \
           f": 4 of {_compared(e2e)} figures more than 2x off:" in out  # kvfill's generate, fill and its two ratios
    assert f"  KVFillConnector generate_s {round(3 * kv['generate_s'], 3):g} vs {kv['generate_s']:g} (3.0x off)" in out
    assert f"  KVFillConnector fill_s {round(3 * kv['fill_s'], 3):g} vs {kv['fill_s']:g} (3.0x off)" in out
    lines = out.splitlines()
    assert any(ln.startswith("  KVFillConnector x in-tree ") and ln.endswith(f" vs {kv['x in-tree']:g} (3.0x off)")
               for ln in lines), out
    assert "the host was busy (load 3.00 on 2 cores before the demo started): other work held the cores, the likely " \
           "cause" in out
    written = json.loads((tmp_path / "e2e.json").read_text())
    assert written["host"]["load_before"] == 3.0 and written["args"]["model"] == "out/tiny-llama"
    got = next(r for r in written["rows"] if r["connector"] == "KVFillConnector")
    assert got["load"] == 3.0 and abs(got["generate_s"] - 3 * kv["generate_s"]) < 1e-3
    assert abs(got["generate_cpu_s"] - 1.5 * kv["generate_s"]) < 1e-3 and abs(got["fill_cpu_s"] - kv["fill_s"]) < 1e-3
    none = next(r for r in written["rows"] if r["connector"] == "none")
    assert none["measured"] == "2 of 16, x8" and none["generate_s"] == doc["none"]["generate_s"]
    assert none["outputs"] == "2/2 x 2"


def _compared(e2e) -> int:
    """How many of the documented run's figures a run of the same rows is compared on."""
    return sum(1 for r in e2e.documented()["rows"] for k in e2e.COMPARED if (r["connector"], k) not in e2e.SELF_RATIOS
               and isinstance(r.get(k), (int, float)) and r[k] > 0)


def test_demo_on_an_idle_host_within_the_documented_figures_says_so(monkeypatch, capsys):
    e2e = _demo_children(monkeypatch, {}, load=0.2)
    assert e2e.main([]) == 0
    out = capsys.readouterr().out
    assert f"all {_compared(e2e)} figures within 2x of the documented run" in out and "FAR" not in out
    assert "busy" not in out


def test_demo_far_from_the_documented_figures_on_an_idle_host_blames_the_cpu_not_the_load(monkeypatch, capsys):
    e2e = _demo_children(monkeypatch, {"DecodeBenchConnector": 0.3}, load=0.2)
    assert e2e.main([]) == 0
    out = capsys.readouterr().out
    db = next(r for r in e2e.documented()["rows"] if r["connector"] == "DecodeBenchConnector")["generate_s"]
    assert f"  DecodeBenchConnector generate_s {round(0.3 * db, 3):g} vs {db:g} (3.3x off)" in out
    assert "the host was not busy: this CPU differs from the documented run's" in out


def test_demo_compares_only_the_documented_workload_and_explains_every_column():
    from kvfill.bench import e2e

    reference = e2e.documented()
    args = {**reference["args"], "requests": 4, "prompt_len": 4000}
    assert e2e.compare_documented([], args, reference, None) == [
        "not compared with the documented run (bench/results/cpu_e2e.json: the table of README.md and "
        "docs/performance.md): it ran another workload (--requests 16 there, 4 here, --prompt-len 8000 there, "
        "4000 here)"]
    assert e2e.compare_documented([], args, reference, "load 3.00 on 2 cores before the demo started")[-1] == \
        "(the host was busy: load 3.00 on 2 cores before the demo started; these figures are not an idle host's)"
    assert e2e.compare_documented([{"connector": "KVFillConnector", "device": "cuda"}], reference["args"], reference,
                                  None)[0].endswith("it ran on vLLM's CPU engine, this run on cuda")
    for column in e2e.COLUMNS[1:]:
        assert f"\n{column} " in "\n" + e2e.LEGEND, column
    rows = [{"connector": "KVFillConnector", "requests": 2, "generate_s": 1.0, "generate_cpu_s": 1.5, "fill_s": 0.5,
             "fill_cpu_s": 0.5, "fill_bytes": 2**20, "startup_s": 1.0, "outputs": [3, 1]}]
    assert e2e.finish_rows(rows, 2, 3) is False  # one request stopped short
    assert rows[0]["outputs"] == "1/2 x 3" and rows[0]["x in-tree"] == "" and rows[0]["fill_MiB"] == 1.0


def _table_figures(doc: str, heading: str) -> dict[str, list[str]]:
    """The end-to-end table under ``heading`` in ``doc``: connector -> its cells."""
    text = (ROOT / doc).read_text()
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| connector"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        label, *cells = [c.strip() for c in line.strip("|").split("|")]
        name = next(k for k, v in (("NullFillConnector", "null reference"), ("KVFillConnector", "KVFillConnector"),
                                   ("DecodeBenchConnector", "DecodeBenchConnector"), ("none", "no connector"))
                    if label.startswith(v))
        rows[name + (":startup" if "startup_fill" in label else "")] = cells
    return rows


@pytest.mark.parametrize("doc,heading", [("README.md", "**End to end**"),
                                         ("docs/performance.md", "### End to end on vLLM's CPU engine")])
def test_the_documented_end_to_end_figures_are_the_committed_runs(doc, heading):
    """The docs' end-to-end table states bench/results/cpu_e2e.json's
    figures, rounded - the run make demo compares itself with."""
    import re

    from kvfill.bench import e2e

    rows = {r["connector"]: r for r in e2e.documented()["rows"]}

    def close(cell: str, value: float) -> bool:
        number = re.match(r"([\d.]+) (s|MiB)", cell)
        if number is None:
            return cell == "—" and value == 0
        decimals = len(number.group(1).partition(".")[2])
        return abs(float(number.group(1)) - value) <= 0.5 * 10 ** -decimals + 1e-9

    table = _table_figures(doc, heading)
    assert set(table) == set(rows)
    for name, (generate, fill, filled) in table.items():
        r = rows[name]
        assert close(generate, r["generate_s"]) and close(fill, r["fill_s"]) and close(filled, r["fill_MiB"]), (name, r)
    if doc == "docs/performance.md":
        assert f"({rows['KVFillConnector']['x in-tree']:.1f}× faster)" in (ROOT / doc).read_text()
