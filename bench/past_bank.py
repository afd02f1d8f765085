"""What replay past a bank's end does to decode, on a real trained model:
``past_bank`` ``wrap`` (the recorded sequence again from its start, keys as
recorded) beside ``rotate`` (the same rows, keys re-rotated to their true
positions) beside a recording as long as the prompts, each judged by
kvfill-check against real prefill (greedy tokens, first divergence,
|Δlogprob|, prompt-lookup drafts' acceptance).

    python bench/past_bank.py                      # SmolLM2-135M, 4 chat prompts of 1024 tokens; banks of 1/2, 1/4, 1/8
    python bench/past_bank.py --lens 512 512 --ratios 2

Each ratio r records the prompts' first L/r positions (``kvfill-record
--positions``): a bank of the same texts, r times shorter than the prompts,
so positions past L/r replay the text's beginning again.  vLLM CPU; its
figures go to bench/results/past-bank-cpu.json and docs/replay.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from kvfill.bench.check_presets import chat_prompts
from kvfill.bench.common import machine_info, write_json

HERE = os.path.dirname(os.path.abspath(__file__))

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def check(out: str, model: str, prompts: str, max_len: int, output_len: int, extra: list[str]) -> dict:
    """One kvfill-check run (real prefill and replay), its report."""
    cmd = [sys.executable, "-m", "kvfill.check", "--model", model, "--prompts", prompts, "--out", out, "--fills",
           "replay", "--dtype", "float32", "--output-len", str(output_len), "--max-tokens", "0", "--time-passes",
           "0", "--max-model-len", str(max_len), "--speculative-config", json.dumps(SPEC), *extra]
    print("running:", " ".join(cmd), flush=True)
    rc = subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode
    with open(os.path.join(out, "report.json")) as f:
        report = json.load(f)
    report["rc"] = rc
    return report


def row(label: str, report: dict) -> dict:
    cmp = report["comparison"]
    tokens, spec, ref = cmp["replay"]["tokens"], cmp["replay"].get("spec") or {}, cmp["prefill"].get("spec") or {}
    div = [d for d in tokens["first_divergence"] if d is not None]
    return {"bank": label, "tokens equal": f"{tokens['equal']}/{tokens['total']}", "share": tokens["share"],
            "prompts identical": f"{tokens['prompts_identical']}/{tokens['prompts']}",
            "first divergence (mean)": round(sum(div) / len(div), 1) if div else None,
            "max |dlogprob|": tokens["max_abs_logprob_diff"], "acceptance": spec.get("acceptance"),
            "prefill acceptance": ref.get("acceptance"), "sample": (report.get("samples") or {}).get("replay"),
            "rc": report["rc"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", type=int, nargs="+", default=[1024] * 4, help="the prompts' lengths in tokens")
    p.add_argument("--ratios", type=int, nargs="+", default=[2, 4, 8], help="prompt length / bank length")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--work", default=os.path.join(os.path.dirname(HERE), "out", "past-bank"))
    p.add_argument("--results", default=os.path.join(HERE, "results"))
    a = p.parse_args(argv)
    from kvfill.bench.real_model import REAL_MODEL_PATH, make_real_model

    t0 = time.time()
    os.makedirs(a.work, exist_ok=True)
    model = make_real_model(os.path.abspath(os.path.join(os.path.dirname(HERE), REAL_MODEL_PATH)))
    prompts = chat_prompts(model, a.lens, os.path.join(a.work, "prompts.jsonl"))
    max_len = max(a.lens) + 64 + a.output_len + 16  # the chat template adds its own tokens
    rows = [row("as long as the prompts (kvfill-check's own recording)",
                check(os.path.join(a.work, "whole"), model, prompts, max_len, a.output_len, []))]
    for r in a.ratios:
        n = min(a.lens) // r
        bank = os.path.join(a.work, f"bank-{n}.safetensors")
        rec = [sys.executable, "-m", "kvfill.record", "--model", model, "--prompts", prompts, "--out", bank,
               "--dtype", "float32", "--max-model-len", str(max_len), "--positions", str(n)]
        print("recording:", " ".join(rec), flush=True)
        subprocess.run(rec, check=True, stdout=subprocess.DEVNULL)
        for mode in ("wrap", "rotate"):
            report = check(os.path.join(a.work, f"{n}-{mode}"), model, prompts, max_len, a.output_len,
                           ["--bank", bank, "--past-bank", mode])
            rows.append(row(f"1/{r} of the prompts ({n} positions), past_bank {mode}", report))
    for x in rows:
        print(x, flush=True)
    write_json(os.path.join(a.results, "past-bank-cpu.json"), {
        "machine": machine_info("cpu"), "command": " ".join(["python bench/past_bank.py", *(argv or sys.argv[1:])]),
        "prompt_tokens": a.lens, "output_len": a.output_len, "seconds": round(time.time() - t0, 1), "rows": rows})
    return 0 if all(x["rc"] in (0, 1) for x in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
