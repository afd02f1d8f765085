"""What synthetic KV does to a real serving benchmark: requests stop at EOS.

    python bench/serve_eos.py                      # 32 chat prompts of real text, concurrency 8, up to 256 tokens
    python bench/serve_eos.py --prompts 16 --concurrency 4 --max-tokens 128

``vllm bench serve`` on a real data set stops each request at its EOS token.
A fill that is not the prompt's own KV changes the text the model writes, so
it changes how long each output is - and with it throughput, TPOT and the
batch the decode runs at.  This measures it on a trained model
(SmolLM2-135M-Instruct, ``kvfill.bench.real_model.make_real_model``, float32):

  1. a fixed prompt set: real English text (the standard library's own
     documentation, ``real_prompts``) of ``--prompt-lens`` tokens, each asked
     to be summarised, in the model's chat template - written once as a
     ShareGPT-format file (what ``vllm bench serve --dataset-name sharegpt``
     reads) and as JSONL (what ``kvfill-record --prompts`` reads);
  2. ``kvfill-record`` over them (the recorder's defaults: every prompt
     whole);
  3. per run - ``none`` (no connector: real prefill), ``replay`` (the bank),
     ``normal`` (kvfill's normal(0.015, 0.1) fill), ``constant`` (0.015) - one
     ``vllm serve`` on 127.0.0.1 (vLLM's defaults, prefix caching on), driven
     once by ``vllm bench serve`` with EOS honoured (no ``--ignore-eos``),
     greedy, ``--max-tokens`` at most per request, and stopped by its process
     group.

Reports per run: request throughput, mean / p99 output length, how many
requests ended at EOS before ``--max-tokens``, TPOT and ITL (mean, p99), how
many outputs are the real-prefill run's text exactly, and the first words of
a few outputs side by side; writes ``bench/results/serve-eos-<device>.json``
and a plot.  Every client run is bounded in prompts and seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from kvfill.bench import common as C
from kvfill.bench.replay_e2e import connector_config
from kvfill.bench.serve import ROOT, Server, device_tag, free_port, serve_args, start_log, vllm_command

RUNS = ("none", "replay", "normal", "constant")
INSTRUCTION = "Summarize the text above in two sentences."


def write_prompts(model: str, lengths: list[int], out_dir: str) -> tuple[str, str, list[int]]:
    """(ShareGPT file, JSONL file, each prompt's token count): the chat
    prompts of the module docstring, the same text in both files."""
    from transformers import AutoTokenizer

    from kvfill.bench.real_model import real_prompts

    tok = AutoTokenizer.from_pretrained(model)
    prompts = []
    for ids in real_prompts(tok, lengths):
        user = f"{tok.decode(ids).strip()}\n\n{INSTRUCTION}"
        prompts.append(tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                               add_generation_prompt=True))
    sharegpt = os.path.join(out_dir, "prompts-sharegpt.json")
    jsonl = os.path.join(out_dir, "prompts.jsonl")
    with open(sharegpt, "w") as f:  # the completion turn is not used: --sharegpt-output-len sets the cap
        json.dump([{"id": str(i), "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "-"}]}
                   for i, p in enumerate(prompts)], f)
    with open(jsonl, "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
    return sharegpt, jsonl, [len(tok(p).input_ids) for p in prompts]


def bench_run(a, run: str, bank: str, sharegpt: str, log) -> dict:
    """One server, one bounded ``vllm bench serve`` run; the figures it saved."""
    port = free_port()
    cmd = vllm_command(*serve_args(a.model, port, max_model_len=a.max_model_len, max_num_seqs=a.concurrency,
                                   kt=connector_config(run, bank)), "--dtype", "float32")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(a.kv_cache_gib)}
    server = Server(cmd, env, os.path.join(a.log_dir, f"serve-{run}.log"), port)
    name = f"eos-{run}.json"
    client = vllm_command(
        "bench", "serve", "--backend", "vllm", "--base-url", server.url(), "--model", a.model,
        "--dataset-name", "sharegpt", "--dataset-path", sharegpt, "--sharegpt-output-len", str(a.max_tokens),
        "--num-prompts", str(a.prompts), "--max-concurrency", str(a.concurrency), "--temperature", "0",
        "--seed", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", a.log_dir, "--result-filename", name,
    )
    try:
        t0 = time.time()
        server.wait_ready(a.start_timeout)
        log(f"{run}: server ready in {time.time() - t0:.0f} s")
        out = subprocess.run(client, capture_output=True, text=True, timeout=a.run_timeout)
        if out.returncode != 0:
            raise RuntimeError(f"vllm bench serve exited {out.returncode}: {out.stderr[-800:]}")
        with open(os.path.join(a.log_dir, name)) as f:
            res = json.load(f)
    finally:
        server.stop()
    res["commands"] = {"server": cmd, "client": client}
    return res


def summarise(run: str, res: dict, ref: dict | None, max_tokens: int) -> dict:
    lens = sorted(res["output_lens"])
    texts, ref_texts = res.get("generated_texts", []), (ref or {}).get("generated_texts", [])
    p99 = lens[min(len(lens) - 1, int(round(0.99 * (len(lens) - 1))))]
    return {
        "run": run, "completed": res["completed"], "request_throughput": round(res["request_throughput"], 3),
        "output_throughput": round(res["output_throughput"], 1),
        "mean_output_len": round(statistics.fmean(lens), 1), "p99_output_len": p99,
        "ended_at_eos": f"{sum(n < max_tokens for n in lens)}/{len(lens)}",
        "mean_tpot_ms": round(res["mean_tpot_ms"], 2), "p99_tpot_ms": round(res["p99_tpot_ms"], 2),
        "mean_itl_ms": round(res["mean_itl_ms"], 2), "p99_itl_ms": round(res["p99_itl_ms"], 2),
        "same_text_as_prefill": f"{sum(t == r for t, r in zip(texts, ref_texts))}/{len(texts)}" if ref else "-",
    }


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("request_throughput", None, "requests/s"), ("mean_output_len", "p99_output_len", "output tokens"),
              ("mean_tpot_ms", "p99_tpot_ms", "TPOT ms"), ("mean_itl_ms", "p99_itl_ms", "ITL ms")]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 3.8))
    runs = [r["run"] for r in rows]
    for ax, (mean, p99, label) in zip(axes, panels):
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs] if p99 else xs, [r[mean] for r in rows], width=0.4 if p99 else 0.6,
               label="mean" if p99 else None)
        if p99:
            ax.bar([x + 0.2 for x in xs], [r[p99] for r in rows], width=0.4, label="p99")
            ax.legend(fontsize=7)
        ax.set_xticks(list(xs), runs)
        ax.set_title(label)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[300, 900], metavar=("MIN", "MAX"),
                   help="text tokens per prompt, spread evenly over [MIN, MAX] (ShareGPT's loader keeps prompts "
                        "of <= 1024 tokens)")
    p.add_argument("--max-tokens", type=int, default=256, help="output cap per request (EOS ends one earlier)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--model", default=os.path.join(ROOT, "out", "smollm2-135m"))
    p.add_argument("--kv-cache-gib", type=int, default=2, help="CPU only: VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds for a server to answer /health")
    p.add_argument("--run-timeout", type=float, default=1800, help="seconds per client run")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--log-dir", default=os.path.join(ROOT, "out", "serve-eos"))
    a = p.parse_args(argv)
    lo, hi = a.prompt_lens
    if not (1 <= lo <= hi <= 1000) or a.prompts < 1 or a.max_tokens < 1 or a.concurrency < 1:
        p.error("expected 1 <= MIN <= MAX <= 1000 for --prompt-lens and --prompts, --max-tokens, --concurrency >= 1")
    from kvfill.bench.real_model import make_real_model

    _, log = start_log()
    os.makedirs(a.log_dir, exist_ok=True)
    a.model = make_real_model(a.model)
    lengths = [lo + (hi - lo) * i // max(1, a.prompts - 1) for i in range(a.prompts)]
    sharegpt, jsonl, counts = write_prompts(a.model, lengths, a.log_dir)
    a.max_model_len = max(counts) + a.max_tokens + 16
    log(f"{a.prompts} prompts of {min(counts)}-{max(counts)} tokens (chat template included)")
    bank = os.path.join(a.log_dir, "bank.safetensors")
    if "replay" in a.runs:
        rec = C.run_child([sys.executable, "-m", "kvfill.record", "--model", a.model, "--prompts", jsonl, "--out",
                           bank, "--dtype", "float32", "--max-model-len", str(a.max_model_len), "--enforce-eager"], "recording",
                          timeout=1800)
        log(next(line for line in rec.stdout.splitlines() if line.startswith("wrote")))
    results = {}
    for run in a.runs:
        results[run] = bench_run(a, run, bank, sharegpt, log)
        log(f"{run}: {results[run]['request_throughput']:.2f} req/s, mean output "
            f"{statistics.fmean(results[run]['output_lens']):.0f} tokens")
    rows = [summarise(run, res, results.get("none"), a.max_tokens) for run, res in results.items()]
    print(C.table(rows, list(rows[0])))
    for i in range(min(3, a.prompts)):
        print(f"prompt {i}:")
        for run, res in results.items():
            print(f"  {run:>8}: {' '.join(res['generated_texts'][i].split()[:12])!r}")
    import vllm

    device, tag = device_tag()
    base = os.path.join(a.out, f"serve-eos-{tag}")
    C.write_json(base + ".json", {
        "machine": C.machine_info(device), "vllm": vllm.__version__,
        "command": "python bench/serve_eos.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "args": vars(a), "prompt_tokens": counts, "rows": rows,
        "runs": {run: {k: res.get(k) for k in ("output_lens", "generated_texts", "commands")}
                 for run, res in results.items()},
    })
    try:
        plot(rows, base + ".png", f"SmolLM2-135M, {a.prompts} chat prompts of real text, c={a.concurrency}, "
                                  f"EOS honoured (<= {a.max_tokens} tokens), {device}")
        print(f"wrote {base}.json and {base}.png")
    except ImportError:
        print(f"wrote {base}.json (no matplotlib: pip install -e '.[bench]' for the plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
