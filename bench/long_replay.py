"""Replay at 128k-token prompts through ``vllm serve`` + ``vllm bench serve``
on vLLM's CPU engine: a tiny Llama of 131072 positions (Llama-3 RoPE
scaling, as Llama 3.1's), a bank recorded by ``kvfill-record`` from two
prompts of a few thousand tokens, and each request's ~128k positions filled
from it - far past the bank's end - three ways:

* ``wrap``, the bank on the caches' device (the default);
* ``rotate``, the bank on the caches' device: keys past the end re-rotated;
* ``rotate``, the bank in host memory (``bank_placement: host``): each step's
  rows staged.

On a GPU with vLLM 0.34's extensible KV cache each server is started with
the ``--gpu-memory-utilization`` that leaves its bank room (``serve.py``:
``replay_utilization``), or not started, saying why.

Every server runs with ``verify: raise`` on its first client run (each
filled row read back; keys turned as the fill turned them) and without it on
the timed run, so the figures are the fill and decode alone.  Per run:
TTFT (what the fill of ~128k positions costs a request, with the one
prefilled token) and TPOT (decode reading ~128k positions of KV), p50 over
the prompts, and the server's own counters (filled and wrapped positions).
On shared CPUs absolute times are noise; the ratios of one run are what to
read, each beside its spread.

    python bench/long_replay.py                  # 130000-token prompts: bench/results/long-replay-cpu.json
    python bench/long_replay.py --input-len 100000 --prompts 2
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from kvfill.bench import common as C
from kvfill.bench import serve as S
from kvfill.bench.models import make_model, make_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
POSITIONS = 131072
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16384}
CONFIGS = {  # name -> the replay connector's extra keys
    "wrap-device": {"past_bank": "wrap", "bank_placement": "device"},
    "rotate-device": {"past_bank": "rotate", "bank_placement": "device"},
    "rotate-host": {"past_bank": "rotate", "bank_placement": "host"},
}


def prompts_file(path: str, n: int, words: int) -> str:
    """``n`` prompts of ``words`` random words of the tiny model's vocabulary (``w3`` .. ``w1023``), one per line."""
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(" ".join(f"w{rng.randrange(3, 1024)}" for _ in range(words)) + "\n")
    return path


def record(model: str, work: str, words: int, log) -> str:
    bank = os.path.join(work, "bank.safetensors")
    if os.path.exists(bank):
        return bank
    cmd = [os.path.join(os.path.dirname(sys.executable), "kvfill-record"), "--model", model,
           "--prompts", prompts_file(os.path.join(work, "prompts.txt"), 2, words), "--out", bank,
           "--max-model-len", "16384", "--enforce-eager"]
    t0 = time.time()
    subprocess.run(cmd, check=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}, timeout=1800)
    log(f"recorded {bank} in {time.time() - t0:.0f} s")
    return bank


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=130000)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--prompts", type=int, default=3, help="timed prompts per server (one more is verified)")
    p.add_argument("--bank-words", type=int, default=3000, help="words per recorded prompt (2 prompts)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--kv-cache-gib", type=int, default=4)
    p.add_argument("--work", default=os.path.join(ROOT, "out", "long-replay"))
    p.add_argument("--results", default=os.path.join(HERE, "results"))
    a = p.parse_args(argv)
    if not 0 < a.input_len <= POSITIONS - a.output_len - 1:
        p.error(f"--input-len {a.input_len}: expected 1 to {POSITIONS - a.output_len - 1} (the model's "
                f"{POSITIONS} positions, less --output-len and one)")
    os.makedirs(a.work, exist_ok=True)
    t_start, log = S.start_log()
    model = make_tokenizer(make_model(os.path.join(ROOT, "out", "tiny-llama-128k"), max_positions=POSITIONS,
                                      rope_scaling=LLAMA3))
    bank = record(model, a.work, a.bank_words, log)
    from kvfill.bank import Bank

    lengths = list(Bank.load(bank).lengths)
    log(f"bank: {len(lengths)} sequences of {lengths} positions; prompts of {a.input_len} tokens")
    runs, peak = {}, None  # vLLM 0.34's measured transient peak, carried from one server to the next
    for name in a.configs:
        args = argparse.Namespace(
            model=model, bank=bank, replay_extra=CONFIGS[name], max_model_len=POSITIONS, concurrency=[1],
            input_len=a.input_len, output_len=a.output_len, prompts_per_level=None, none_max_prompts=1,
            kv_cache_gib=a.kv_cache_gib, enforce_eager=True, run_timeout=1800, repeat=1, start_timeout=600,
            log_dir=os.path.join(a.work, name), fill_std=0.1, measured_peak=peak)
        verified = dict(args.replay_extra, verify="raise")
        args.replay_extra, args.prompts_per_level = verified, 1
        checked, _, _ = S.run_connector(args, "replay", log)  # one verified request: every row read back
        args.replay_extra, args.prompts_per_level = CONFIGS[name], a.prompts
        records, metrics, commands = S.run_connector(args, "replay", log)
        peak = args.measured_peak  # run_connector: the replay servers' bank room (vLLM 0.34 on CUDA)
        runs[name] = {"verified": checked, "records": records, "server_metrics": metrics, "commands": commands}
    rows = []
    for name, run in runs.items():
        rec = next((r for r in run["records"] if "error" not in r), None)
        ok = all("error" not in r and not r.get("failed") for r in run["verified"])
        if rec is None:
            rows.append({"config": name, "error": run["records"][0].get("error"), "verified": ok})
            continue
        m = run["server_metrics"]
        rows.append({"config": name, "verified": ok, "completed": rec["completed"],
                     "p50_ttft_ms": rec["p50_ttft_ms"], "p99_ttft_ms": rec["p99_ttft_ms"],
                     "p50_tpot_ms": rec["p50_tpot_ms"], "p99_tpot_ms": rec["p99_tpot_ms"],
                     "wrapped_positions": m.get("vllm:kvfill_wrapped_positions_total"),
                     "mismatched": m.get("vllm:kvfill_mismatched_elements_total")})
    base = {r["config"]: r for r in rows if "p50_ttft_ms" in r}.get("wrap-device")
    for r in rows:
        if base and "p50_ttft_ms" in r:
            r["ttft_vs_wrap"] = round(r["p50_ttft_ms"] / base["p50_ttft_ms"], 3)
            r["tpot_vs_wrap"] = round(r["p50_tpot_ms"] / base["p50_tpot_ms"], 3)
    import vllm

    out = os.path.join(a.results, "long-replay-cpu.json")
    C.write_json(out, {"machine": C.machine_info("cpu"), "vllm": vllm.__version__,
                       "command": "python bench/long_replay.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                       "bank_lengths": lengths, "input_len": a.input_len, "output_len": a.output_len,
                       "wall_s": round(time.time() - t_start, 1), "rows": rows, "runs": runs})
    print(C.table(rows, ["config", "verified", "completed", "p50_ttft_ms", "p99_ttft_ms", "ttft_vs_wrap",
                         "p50_tpot_ms", "p99_tpot_ms", "tpot_vs_wrap", "wrapped_positions"]))
    print(f"wrote {out} ({time.time() - t_start:.0f} s); TTFT/TPOT p50 and p99 over {a.prompts} prompts each - "
          f"one run per configuration on a shared CPU: read the ratios beside the p50-p99 spread")
    return 0 if all(r.get("verified") and "error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
