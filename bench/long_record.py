"""A long prompt recorded and replayed end to end on vLLM's CPU engine: the
tiny Llama (32k positions), one prompt of ``--tokens`` tokens, kvfill-check
recording its bank (the recorder reading the prompt one layer at a time),
running real prefill and replay, and comparing their greedy tokens - with
the run's wall time and the peak resident memory of its processes.

    python bench/long_record.py                   # 32000 tokens: bench/results/long-record-cpu.json
    python bench/long_record.py --tokens 4000     # smaller

It runs ``bench/check_presets.py llama --lens N --tag longN`` (its report:
``bench/results/check-llama-longN-cpu.*``), every step in one process
(``--in-process``), eager, decode time not measured; peak memory is the
largest resident set of the processes it waited for (``getrusage``).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32000, help="the prompt's length (the tiny Llama holds 32768)")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--results", default=os.path.join(HERE, "results"))
    p.add_argument("--work", default=None, help="the check's work folder (default: out/check-llama-longN)")
    a = p.parse_args(argv)
    if not 0 < a.tokens <= 32768 - a.output_len:
        p.error(f"--tokens {a.tokens}: expected 1 to {32768 - a.output_len} (the tiny Llama's 32768 positions, "
                f"less --output-len)")
    tag = f"long{a.tokens // 1000}k" if a.tokens % 1000 == 0 else f"long{a.tokens}"
    cmd = [sys.executable, os.path.join(HERE, "check_presets.py"), "llama", "--lens", str(a.tokens), "--tag", tag,
           "--results", a.results, *(["--work", a.work] if a.work else []), "--",
           "--output-len", str(a.output_len), "--max-tokens", "0", "--time-passes", "0", "--fills", "replay",
           "--max-model-len", str(a.tokens + a.output_len + 1), "--in-process"]
    print(" ".join(cmd), flush=True)
    start = time.perf_counter()
    rc = subprocess.run(cmd).returncode
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # Linux: KiB
    report = os.path.join(a.results, f"check-llama-{tag}-cpu.json")
    tokens = None
    if rc == 0 and os.path.exists(report):
        with open(report) as f:
            data = json.load(f)
        tokens = data["comparison"]["replay"]["tokens"]
    from kvfill.bench.common import machine_info, write_json

    row = {"tokens": a.tokens, "output_len": a.output_len, "rc": rc, "seconds": round(seconds, 1),
           "peak_rss_gib": round(peak_kib / 2**20, 2),
           "replay_tokens": None if tokens is None else f"{tokens['equal']}/{tokens['total']}",
           "replay_max_abs_logprob_diff": None if tokens is None else tokens["max_abs_logprob_diff"],
           "report": os.path.relpath(report, os.path.dirname(HERE)), "command": " ".join(["python bench/long_record.py",
                                                                                          *(argv or sys.argv[1:])])}
    print(json.dumps(row, indent=1))
    write_json(os.path.join(a.results, "long-record-cpu.json"), {"machine": machine_info("cpu"), **row})
    return 0 if rc == 0 and tokens is not None and tokens["equal"] == tokens["total"] else 1


if __name__ == "__main__":
    sys.exit(main())
