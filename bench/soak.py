"""Bounded soak of the serving path: kvfill under 256 concurrent requests, a KV
cache small enough to force preemptions, and every fill verified.

    python bench/soak.py                  # make soak: ~3 minutes of load on CPU
    python bench/soak.py --minutes 10 --concurrency 256 --kv-cache-gib 1

One vLLM server on 127.0.0.1 with KVFillConnector (``verify: "log"``: each
fill is re-read and compared with the value function, a mismatch is logged),
driven by ``vllm bench serve`` rounds until ``--minutes`` have passed (at most
``--max-rounds``), then stopped by its process group.  Reports failed
requests, preemptions (vLLM's counter), refills (requests kvfill filled more
than once: preempted and filled again) and verify mismatches (server log),
and writes ``bench/results/soak-<device>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from kvfill.bench import common as C
from kvfill.bench.models import make_model, make_tokenizer
from kvfill.bench.serve import (
    Server,
    add_server_args,
    device_tag,
    free_port,
    kv_transfer_config,
    serve_args,
    start_log,
    vllm_command,
)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--max-rounds", type=int, default=20)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompts-per-round", type=int, default=512)
    p.add_argument("--input-len", type=int, default=1000)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-cache-gib", type=int, default=1, help="small: 256 x 1000 tokens do not fit, vLLM preempts")
    add_server_args(p, "soak")
    a = p.parse_args(argv)
    t_start, log = start_log()
    make_tokenizer(make_model(a.model))
    os.makedirs(a.log_dir, exist_ok=True)
    port = free_port()
    kt = kv_transfer_config("kvfill", {"fill_std": a.fill_std, "verify": "log"})
    cmd = vllm_command(*serve_args(a.model, port, max_model_len=a.input_len + a.output_len + 64,
                                   max_num_seqs=a.concurrency, kt=kt))
    server = Server(cmd, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(a.kv_cache_gib)},
                    os.path.join(a.log_dir, "server.log"), port)
    rounds, metrics = [], {}
    try:
        server.wait_ready(a.start_timeout)
        log(f"server ready (port {port})")
        deadline = t_start + a.minutes * 60
        while time.time() < deadline and len(rounds) < a.max_rounds:
            name = f"round{len(rounds)}.json"
            client = vllm_command(
                "bench", "serve", "--backend", "vllm", "--base-url", server.url(), "--model", a.model,
                "--dataset-name", "random", "--random-input-len", str(a.input_len),
                "--random-output-len", str(a.output_len), "--num-prompts", str(a.prompts_per_round),
                "--max-concurrency", str(a.concurrency), "--ignore-eos", "--seed", str(len(rounds)),
                "--save-result", "--result-dir", a.log_dir, "--result-filename", name)
            left = max(60.0, deadline - time.time() + 600)
            try:
                out = subprocess.run(client, capture_output=True, text=True, timeout=left)
            except subprocess.TimeoutExpired:
                rounds.append({"round": len(rounds), "error": f"client still running after {left:.0f} s"})
                log(f"round {len(rounds) - 1}: client timed out")
                break
            path = os.path.join(a.log_dir, name)
            if out.returncode != 0 or not os.path.exists(path):
                rounds.append({"round": len(rounds), "error": f"exit {out.returncode}: {out.stderr[-300:]}"})
                log(f"round {len(rounds) - 1}: client failed")
                continue
            with open(path) as f:
                res = json.load(f)
            rounds.append({"round": len(rounds), "num_prompts": a.prompts_per_round, "completed": res["completed"],
                           "failed": res["failed"], "duration": res["duration"],
                           "request_throughput": res["request_throughput"]})
            log(f"round {len(rounds) - 1}: {res['completed']} completed, {res['failed']} failed, "
                f"{res['request_throughput']:.1f} req/s")
        metrics = server.metrics()
    except Exception as exc:  # noqa: BLE001 - the summary below still gets written
        log(f"{type(exc).__name__}: {exc}")
        rounds.append({"round": len(rounds), "error": f"{type(exc).__name__}: {exc}"})
    finally:
        server.stop()
    with open(server.log_path) as f:
        server_log = f.read()
    completed = sum(r.get("completed", 0) for r in rounds)
    sent = a.prompts_per_round * len(rounds)
    summary = {
        "rounds": len(rounds),
        "requests": sent,
        "failed_requests": sent - completed,
        "preemptions": metrics.get("vllm:num_preemptions_total"),
        "fills_of_requests": metrics.get("vllm:kvfill_requests_total"),
        "refills": None if "vllm:kvfill_requests_total" not in metrics else
        metrics["vllm:kvfill_requests_total"] - completed,
        "verified_fills": metrics.get("vllm:kvfill_verified_fills_total"),
        "mismatched_elements": metrics.get("vllm:kvfill_mismatched_elements_total"),
        "verify_mismatch_lines": server_log.count("KVFillConnector: verify found"),
        "skipped_fills": server_log.count("skipped this step's fill"),
        "minutes": round((time.time() - t_start) / 60, 2),
    }
    device, tag = device_tag()
    payload = {"machine": C.machine_info(device), "command": "python bench/soak.py " + " ".join(argv or sys.argv[1:]),
               "server_command": cmd, "args": vars(a), "summary": summary, "rounds": rounds,
               "server_metrics": metrics}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"soak-{tag}.json")
    C.write_json(path, payload)
    for k, v in summary.items():
        print(f"{k:>22}: {v}")
    print(f"wrote {path}")
    bad = (summary["failed_requests"] or summary["verify_mismatch_lines"] or summary["skipped_fills"]
           or summary["mismatched_elements"] or not summary["verified_fills"])
    return 1 if bad or not rounds else 0


if __name__ == "__main__":
    sys.exit(main())
