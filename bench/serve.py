"""Serving benchmark with a real client: vLLM's OpenAI server per connector,
driven by ``vllm bench serve`` over a concurrency sweep.

    python bench/serve.py                       # make serve-bench: CPU defaults below
    python bench/serve.py --concurrency 8 --connectors null kvfill --input-len 4000

For each connector - ``null`` (the limit: grants kvfill's tokens, writes
nothing; kvfill.bench.null_connector), ``kvfill`` (loaded by plugin name),
``in-tree`` (vLLM's DecodeBenchConnector) and ``none`` (real prefill) - one
server is started on 127.0.0.1 (a free port), driven with the random dataset
at each concurrency, scraped at /metrics, and stopped by its process group.
Every client run is bounded in prompts and seconds; a server that does not
answer /health within ``--start-timeout`` is stopped and recorded as failed.
Writes ``bench/results/serve-<device>.json`` (one record per connector and
concurrency, with the machine, the vLLM version and the exact commands) and a
plot of throughput, TTFT, TPOT and ITL (p50/p99) against concurrency.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

from kvfill.bench import common as C
from kvfill.bench.models import make_model, make_tokenizer
from kvfill.bench.null_connector import KV_TRANSFER_CONFIG as NULL_CONFIG
from kvfill.check.child import dying_with_this_process
from kvfill.check.prefill_probe import prefill_probe
from kvfill.check.serving import Server, free_port, vllm_command

# replay: kvfill from --bank (not in the default sweep); *-startup: the connector's startup_fill (the whole cache
# filled once at start, nothing per request: what a user who only wants speed picks for a dense model)
CONNECTORS = ("null", "kvfill", "kvfill-startup", "in-tree", "in-tree-startup", "none", "replay")
METRICS = ("ttft", "tpot", "itl", "e2el")
PROBE_IDS = [10 + (i * 37) % 200 for i in range(256)]  # --prefill-probe's prompt: 16 blocks of 16 tokens
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kv_transfer_config(connector: str, extra: dict) -> dict | None:
    if connector == "none":
        return None
    startup = connector.endswith("-startup")
    base = {
        "null": NULL_CONFIG,
        "kvfill": {"kv_connector": "KVFillConnector", "kv_role": "kv_both"},
        "replay": {"kv_connector": "KVFillConnector", "kv_role": "kv_both"},
        "in-tree": {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_both"},
    }[connector.removesuffix("-startup")]
    return {**base, "kv_connector_extra_config": {**extra, **({"startup_fill": True} if startup else {})}}


def serve_args(model: str, port: int, *, max_model_len: int, max_num_seqs: int, kt: dict | None,
               enforce_eager: bool = True, gpu_memory_utilization: float | None = None) -> list[str]:
    """``vllm serve`` on 127.0.0.1 only, with the connector config ``kt`` (None: no connector)."""
    args = ["serve", model, "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--seed", "0"]
    if enforce_eager:
        args.append("--enforce-eager")
    if gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if kt is not None:
        args += ["--kv-transfer-config", json.dumps(kt)]
    return args


def device_tag() -> tuple[str, str]:
    """(torch device, results file tag: "cpu" or the GPU's name as a slug)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", "cpu"
    return "cuda", re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def run_level(server: Server, a, connector: str, concurrency: int, result_dir: str) -> tuple[dict, list[list[str]]]:
    """``a.repeat`` client runs at one concurrency (other prompts each run);
    the record holds each run's figures and, at the top, their medians."""
    runs, cmds = [], []
    for i in range(a.repeat):
        run, cmd = run_client(server, a, connector, concurrency, result_dir, i)
        runs.append(run)
        cmds.append(cmd)
        if "error" in run:
            break
    rec = {"connector": connector, "concurrency": concurrency, "num_prompts": runs[0]["num_prompts"]}
    if any("error" in r for r in runs):
        rec["error"] = next(r["error"] for r in runs if "error" in r)
    else:
        for k in runs[0]:
            if k != "num_prompts" and all(isinstance(r.get(k), (int, float)) for r in runs):
                rec[k] = float(statistics.median(r[k] for r in runs))
        rec["failed"] = sum(r["failed"] for r in runs)
    if a.repeat > 1:
        rec["runs"] = runs
    return rec, cmds


def run_client(server: Server, a, connector: str, concurrency: int, result_dir: str, run: int) -> tuple[dict, list[str]]:
    """One ``vllm bench serve`` run: bounded in prompts and seconds."""
    n = a.prompts_per_level or max(32, 2 * concurrency)
    if connector == "none":
        n = min(n, a.none_max_prompts)
    name = f"{connector}-c{concurrency}" + (f"-run{run}" if a.repeat > 1 else "") + ".json"
    cmd = vllm_command(
        "bench", "serve", "--backend", "vllm", "--base-url", server.url(), "--model", a.model,
        "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
        "--num-prompts", str(n), "--max-concurrency", str(concurrency), "--ignore-eos",
        # Prompts of one level (and run) share no prefix with another's: no prefix-cache hits across them.
        "--seed", str(1000 + concurrency + 100_000 * run),
        "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", result_dir, "--result-filename", name,
    )
    rec = {"num_prompts": n}
    try:
        # dying with this script: a bench killed outright leaves no client running (its server has a Guard)
        out = subprocess.run(dying_with_this_process(cmd), capture_output=True, text=True, timeout=a.run_timeout,
                             env=os.environ.copy())
        ok = out.returncode == 0 and os.path.exists(os.path.join(result_dir, name))
    except subprocess.TimeoutExpired:
        ok, out = False, None
    if not ok:
        rec["error"] = "timeout" if out is None else f"exit {out.returncode}: {out.stderr[-500:]}"
        return rec, cmd
    with open(os.path.join(result_dir, name)) as f:
        res = json.load(f)
    rec.update({k: res.get(k) for k in ("completed", "failed", "duration", "request_throughput",
                                        "output_throughput")})
    for m in METRICS:
        for stat in ("mean", "p50", "p99"):
            rec[f"{stat}_{m}_ms"] = res.get(f"{stat}_{m}_ms")
    return rec, cmd


def replay_utilization(a, replay: dict, max_model_len: int, log) -> tuple[float | None, str | None]:
    """The replay server's ``--gpu-memory-utilization`` and, where its bank
    would have no room, why it is not started: under vLLM 0.34's extensible
    KV cache (CUDA's default) the connector loads the bank after warmup
    beside a cache sized to leave only vLLM's own peak free, so the room is
    made (or a ``--gpu-memory-utilization`` that leaves none refused) before
    the server starts (``kvfill.check.device_memory.replay_room``; the peak
    as an earlier server of this run measured it, ``a.measured_peak``)."""
    from kvfill.check.device_memory import replay_room

    engine = {"max_model_len": max_model_len, "enforce_eager": a.enforce_eager,
              "gpu_memory_utilization": getattr(a, "gpu_memory_utilization", None)}
    plan = replay_room(engine, replay, a.bank, max_model_len, getattr(a, "measured_peak", None))
    if plan is None:
        return engine["gpu_memory_utilization"], None
    if plan.refused:
        return None, plan.line
    log(f"replay: {plan.line}")
    return plan.utilization or engine["gpu_memory_utilization"], None


def run_connector(a, connector: str, log) -> tuple[list[dict], dict, list[list[str]]]:
    from kvfill.check.device_memory import measured_peak

    port = free_port()
    replay = {"fill_mode": "replay", "bank": a.bank, **getattr(a, "replay_extra", {})}
    max_model_len = getattr(a, "max_model_len", None) or a.input_len + a.output_len + 64
    utilization = getattr(a, "gpu_memory_utilization", None)
    if connector == "replay":
        utilization, refused = replay_utilization(a, replay, max_model_len, log)
        if refused:
            log(f"{connector}: not started - {refused}")
            return [{"connector": connector, "concurrency": None, "error": refused}], {}, []
    args = serve_args(a.model, port, max_model_len=max_model_len,
                      max_num_seqs=max(a.concurrency), enforce_eager=a.enforce_eager,
                      gpu_memory_utilization=utilization,
                      kt=kv_transfer_config(connector, replay if connector == "replay"
                                            else {"fill_mean": 0.015, "fill_std": a.fill_std}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(a.kv_cache_gib)}
    os.makedirs(a.log_dir, exist_ok=True)
    log_path = os.path.join(a.log_dir, f"serve-{connector}.log")
    server = Server(vllm_command(*args), env, log_path, port)
    records, cmds, metrics = [], [server.cmd], {}
    try:
        t0 = time.time()
        server.wait_ready(a.start_timeout)
        log(f"{connector}: server ready in {time.time() - t0:.0f} s (port {port})")
        for c in a.concurrency:
            rec, level_cmds = run_level(server, a, connector, c, a.log_dir)
            records.append(rec)
            cmds += level_cmds
            log(f"{connector} c={c}: " + (rec.get("error") or f"{rec['request_throughput']:.2f} req/s, "
                                                              f"TTFT p50 {rec['p50_ttft_ms']:.0f} ms"))
        metrics = server.metrics()  # the client's runs' (the probe's requests after them)
        if getattr(a, "prefill_probe", False) and connector in ("kvfill", "replay"):
            a.probes[connector] = probe = prefill_probe(server.url(), a.model, PROBE_IDS, timeout=a.run_timeout)
            log(f"{connector}: kvfill_prefill under prefix caching - {'ok' if probe['ok'] else probe}")
    except Exception as exc:  # noqa: BLE001 - record it, stop this server, go on with the next
        log(f"{connector}: {type(exc).__name__}: {exc}")
        records.append({"connector": connector, "concurrency": None, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        server.stop()
        if os.path.exists(log_path):  # vLLM 0.34's measured peak: the next replay server's room
            with open(log_path, errors="replace") as f:
                a.measured_peak = measured_peak(f.read()) or getattr(a, "measured_peak", None)
    return records, metrics, cmds


def add_server_args(p: argparse.ArgumentParser, log_dir: str) -> None:
    """Options shared by the serving scripts: the model, the server's start, where results go."""
    p.add_argument("--fill-std", type=float, default=0.1)
    p.add_argument("--model", default=os.path.join(ROOT, "out", "tiny-llama"))
    p.add_argument("--start-timeout", type=float, default=600, help="seconds for a server to answer /health")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--log-dir", default=os.path.join(ROOT, "out", log_dir))


def start_log():
    """(start time, a logger that prints the seconds since then)."""
    t_start = time.time()
    return t_start, lambda msg: print(f"[{time.time() - t_start:6.0f}s] {msg}", flush=True)


def plot(records: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    panels = [("request_throughput", None, "requests/s"), ("ttft", "TTFT", "ms"), ("tpot", "TPOT", "ms"),
              ("itl", "ITL", "ms")]
    for ax, (key, label, unit) in zip(axes, panels):
        for conn in CONNECTORS:
            rows = [r for r in records if r["connector"] == conn and r.get("concurrency") and "error" not in r]
            if not rows:
                continue
            xs = [r["concurrency"] for r in rows]
            if label is None:
                ax.plot(xs, [r[key] for r in rows], marker="o", label=conn)
            else:
                line, = ax.plot(xs, [r[f"p50_{key}_ms"] for r in rows], marker="o", label=f"{conn} p50")
                ax.plot(xs, [r[f"p99_{key}_ms"] for r in rows], marker="x", ls="--", color=line.get_color(),
                        label=f"{conn} p99")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(label or "throughput")
        ax.set_ylabel(unit)
        if label is not None:
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


COLUMNS = ["connector", "concurrency", "num_prompts", "completed", "failed", "request_throughput",
           "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "p50_itl_ms", "p99_itl_ms"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connectors", nargs="+", choices=CONNECTORS, default=[c for c in CONNECTORS if c != "replay"])
    p.add_argument("--bank", default=None, help="connector 'replay': a bank recorded by kvfill-record")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--input-len", type=int, default=4000)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--prompts-per-level", type=int, default=None, help="default: max(32, 2 x concurrency)")
    p.add_argument("--none-max-prompts", type=int, default=32,
                   help="cap for the no-connector server (real prefill of every prompt is slow on CPU)")
    p.add_argument("--kv-cache-gib", type=int, default=4, help="CPU only: VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="every server's; replay under vLLM 0.34's extensible KV cache: unset, the one that leaves "
                        "the bank room (a value that leaves none is refused before the server starts)")
    p.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false")
    p.add_argument("--run-timeout", type=float, default=1800, help="seconds per client run")
    p.add_argument("--prefill-probe", action="store_true",
                   help="kvfill's servers, after the client: a prompt filled, then asked with kvfill_prefill true, "
                        "must decode a cache-salted request's tokens, and a malformed value get HTTP 400 "
                        "(check/prefill_probe.py)")
    p.add_argument("--repeat", type=int, default=1,
                   help="client runs per level (other prompts each); a record's figures are their medians")
    add_server_args(p, "serve")
    a = p.parse_args(argv)
    if a.repeat < 1:
        p.error(f"--repeat {a.repeat}: expected an int >= 1")
    if "replay" in a.connectors and not a.bank:
        p.error("--connectors replay needs --bank PATH (record one with `kvfill-record`)")
    if a.bank:
        a.bank = os.path.abspath(a.bank)
    _, log = start_log()
    make_tokenizer(make_model(a.model))
    import vllm

    device, tag = device_tag()
    records, metrics, commands = [], {}, {}
    a.probes = {}
    for conn in a.connectors:
        recs, metrics[conn], commands[conn] = run_connector(a, conn, log)
        records += recs
    os.makedirs(a.out, exist_ok=True)
    payload = {
        "machine": C.machine_info(device), "vllm": vllm.__version__,
        "command": "python bench/serve.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": {k: v for k, v in vars(a).items() if k != "probes"}, "commands": commands,
        "server_metrics": metrics, "records": records, **({"prefill_probe": a.probes} if a.probes else {}),
    }
    base = os.path.join(a.out, f"serve-{tag}")
    C.write_json(base + ".json", payload)
    ok_rows = [r for r in records if "error" not in r]
    print(C.table([{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()} for r in ok_rows],
                  COLUMNS))
    by = {(r["connector"], r["concurrency"]): r for r in ok_rows}
    for c in a.concurrency:
        kv, null, intree = by.get(("kvfill", c)), by.get(("null", c)), by.get(("in-tree", c))
        replay = by.get(("replay", c))
        if replay and kv:
            print(f"c={c}: replay / kvfill throughput {replay['request_throughput'] / kv['request_throughput']:.3f}, "
                  f"TTFT p50 {replay['p50_ttft_ms'] / kv['p50_ttft_ms']:.2f}x")
        if kv and null:
            print(f"c={c}: kvfill / null throughput {kv['request_throughput'] / null['request_throughput']:.3f}, "
                  f"TTFT p50 {kv['p50_ttft_ms'] / null['p50_ttft_ms']:.2f}x"
                  + (f"; kvfill / in-tree throughput {kv['request_throughput'] / intree['request_throughput']:.2f}"
                     if intree else ""))
    try:
        plot(records, base + ".png", f"{a.input_len}-token prompts, {a.output_len} output tokens, {device}")
        print(f"wrote {base}.json and {base}.png")
    except ImportError:
        print(f"wrote {base}.json (no matplotlib: pip install -e '.[bench]' for the plot)")
    failed = [r for r in records if "error" in r or r.get("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
