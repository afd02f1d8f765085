"""Routing fidelity: does a mixture-of-experts model route decode tokens over
filled KV as it does over real prefill?

    python bench/moe_fidelity.py      # 256 held-out prompts x 256 tokens, 64 greedy tokens; bank over 128 others
    python bench/moe_fidelity.py --held-out 64 --record 16 --output-len 32 --json out/moe-fidelity-small.json

A tiny random-weight Mixtral (made once in ``out/tiny-mixtral``, see "Model")
decodes the same held-out prompts in four runs, one new engine after another in one child process:
  * ``prefill``  - no connector: vLLM computes the prompts' KV
  * ``replay``   - kvfill, ``fill_mode: replay`` from a bank recorded with real
                   prefill over *other* prompts of the same distribution (a
                   held-out prompt matches no recorded key, so it replays the
                   sequence a hash of its prompt picks; N = the prompt length,
                   so no position wraps)
  * ``normal``   - kvfill, normal(mean, std) with the mean and std of the
                   bank's real KV (measured over all its values; reported)
  * ``constant`` - kvfill, the constant 0.015 (the in-tree connector's default)
A forward hook on every MoE layer's router (``enforce_eager``: hooks do not
fire in a compiled graph) counts the top-k experts it selects for each
decode-step token (position >= the prompt length; the prompt's last token,
computed for real in every run, is not counted).  Reported per run and layer:
the normalised expert-load histogram and its total variation distance to
``prefill``'s, ``TV(p, q) = 1/2 sum_e |p_e - q_e|`` (0: the same load, 1:
disjoint); as a noise floor, the TV between ``prefill``'s loads over two
disjoint halves of the held-out prompts (half the sample each, so it is
about sqrt(2) above the sampling noise of a full-size comparison), and as a
scale, ``prefill``'s TV to the uniform load.  Writes
``bench/results/moe-fidelity-cpu.json`` and ``.png`` (TV per layer per run;
the expert loads per layer).

Model: 4 layers, hidden 256, 8 experts top-2, 4 KV heads x 64, vocabulary
1024 (the word-level tokenizer of ``kvfill.bench.models``), float32, weights
normal(0, 0.1), and one random vector of that scale added to every token
embedding.  That shared direction stands in for the common direction of a
trained model's hidden states (they are anisotropic); without it a random
router sees isotropic inputs and spreads the decode tokens of any context
evenly over the experts, and the load cannot tell one KV from another
(measured, 32 prompts x 16 tokens: prefill's TV to uniform 0.05, below the
noise floor 0.07-0.09, for weight std 0.1 and 0.2; every fill within the floor).
With it (``--shared-embedding 1``) the load is uneven and the greedy outputs
still depend on the context.

Prompts: each is a phrase of 4-16 words from a topic of 32 words, repeated to
the prompt length with a fifth of the words swapped for other words of the
topic - prompts differ from each other (uniform random words would average
out to one context), and the recorded and held-out prompts come from the same
generator with different seeds.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time

from kvfill.bench.common import child_result, print_result, run_child, run_each
from kvfill.bench.models import make_tokenizer
from kvfill.bench.moe_measure import (
    EXPERTS, FILL_MEAN, HELD_OUT_SEED, LAYERS, RECORD_SEED, RUNS, TOP_K, TOPIC_WORDS, bank_stats, make_moe_model,
    make_prompts, max_model_len, model_config, run_one, write_lines,
)

COLORS = {"prefill": "tab:blue", "replay": "tab:orange", "normal": "tab:green", "constant": "tab:red"}


# ------------------------------------------------------------ analysis
def load(counts_per_prompt: list, prompts: range | list) -> list[list[float]]:
    """Normalised expert load per layer, summed over the given prompts."""
    out = []
    for layer in range(LAYERS):
        total = [sum(counts_per_prompt[p][layer][e] for p in prompts) for e in range(EXPERTS)]
        n = sum(total)
        out.append([x / n if n else 0.0 for x in total])
    return out


def tv(p: list[float], q: list[float]) -> float:
    return 0.5 * sum(abs(x - y) for x, y in zip(p, q))


def equal_tokens(ref: list[list[int]], other: list[list[int]]) -> str:
    same = sum(x == y for r, o in zip(ref, other) for x, y in zip(r, o))
    return f"{same}/{sum(len(r) for r in ref)}"


def plot(rows: list[dict], loads: dict, floor: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + LAYERS, figsize=(4 * (1 + LAYERS), 3.8))
    ax = axes[0]
    others = [r["run"] for r in rows]
    width = 0.8 / len(others)
    for i, run in enumerate(others):
        ax.bar([layer + (i - (len(others) - 1) / 2) * width for layer in range(LAYERS)],
               next(r for r in rows if r["run"] == run)["tv_per_layer"], width, label=run, color=COLORS[run])
    ax.plot(range(LAYERS), floor, "k_", markersize=22, mew=2, label="noise floor (halves)")
    ax.set_xticks(range(LAYERS))
    ax.set_xlabel("layer")
    ax.set_ylabel("TV distance to prefill")
    ax.set_title("expert load vs real prefill")
    ax.set_ylim(0, 1.3 * max(max(r["tv_per_layer"]) for r in rows))
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    width = 0.8 / len(loads)
    for layer, ax in enumerate(axes[1:]):
        for i, (run, per_layer) in enumerate(loads.items()):
            ax.bar([e + (i - (len(loads) - 1) / 2) * width for e in range(EXPERTS)], per_layer[layer], width,
                   label=run, color=COLORS[run])
        ax.axhline(1 / EXPERTS, color="k", lw=0.7, ls=":")
        ax.set_xticks(range(EXPERTS))
        ax.set_xlabel("expert")
        ax.set_title(f"layer {layer}: decode-token load")
        if layer == 0:
            ax.set_ylabel("share of top-k selections")
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--held-out", type=int, default=256, help="prompts decoded in every run")
    p.add_argument("--record", type=int, default=128,
                   help="other prompts the replay bank is recorded over (replay's load averages over this many "
                        "contexts: fewer add their own sampling noise)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--init-std", type=float, default=0.1,
                   help="the model's weight std (initializer_range), when it is made")
    p.add_argument("--shared-embedding", type=float, default=1.0,
                   help="scale of the direction shared by every token embedding, when the model is made "
                        "(module docstring: 0 makes the load uniform whatever the KV)")
    p.add_argument("--model", default=None, help="model folder (default out/tiny-mixtral, made if missing)")
    p.add_argument("--dtype", default="float32", help="model and KV dtype, for the recording and every run")
    p.add_argument("--timeout", type=float, default=600, help="seconds per subprocess")
    p.add_argument("--json", default=None, help="default bench/results/moe-fidelity-cpu.json (and .png beside it)")
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)
    p.add_argument("--bank", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--fill-mean", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fill-std", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    out_dir = os.path.join(here, "..", "out", "moe-fidelity")
    a.model = os.path.abspath(a.model or os.path.join(here, "..", "out", "tiny-mixtral"))
    if a.only:
        print_result(run_each(a.only, lambda run: run_one(a, run)))
        return 0
    t_start = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    make_tokenizer(make_moe_model(a.model, a.init_std, a.shared_embedding))
    record_prompts = make_prompts(a.record, a.prompt_len, RECORD_SEED)
    held_out = make_prompts(a.held_out, a.prompt_len, HELD_OUT_SEED)
    if set(record_prompts) & set(held_out):
        raise SystemExit("a held-out prompt equals a recorded one; change the seeds")
    record_file, held_out_file = os.path.join(out_dir, "record-prompts.txt"), os.path.join(out_dir, "prompts.txt")
    write_lines(record_file, record_prompts)
    write_lines(held_out_file, held_out)
    bank = os.path.join(out_dir, "bank.safetensors")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    record_cmd = [sys.executable, "-m", "kvfill.record", "--model", a.model, "--prompts", record_file, "--out", bank,
                  "--positions", str(a.prompt_len), "--dtype", a.dtype, "--max-model-len", str(max_model_len(a)),
                  "--enforce-eager"]
    print(f"recording {a.record} prompts ...", flush=True)
    rec = run_child(record_cmd, "recording", timeout=a.timeout, env=env)
    print(next(line for line in rec.stdout.splitlines() if line.startswith("wrote")), flush=True)
    stats = bank_stats(bank)
    a.fill_mean, a.fill_std = stats["mean"], stats["std"]
    from transformers import AutoTokenizer

    from kvfill.bank import BankIndex

    tok = AutoTokenizer.from_pretrained(a.model)
    index = BankIndex.read(bank)
    replayed = [index.sequence_for(tok(line).input_ids) for line in held_out]
    print(f"real KV in the bank: mean {stats['mean']:.4f}, std {stats['std']:.4f} (K std {stats['k_std']:.4f}, "
          f"V std {stats['v_std']:.4f}); normal fill: the same mean and std; the held-out prompts "
          f"replay {len(set(replayed))} of the {index.num_sequences} recorded sequences", flush=True)

    cmd = [sys.executable, os.path.abspath(__file__), "--only", ",".join(RUNS), "--bank", bank, "--prompts-file",
           held_out_file, "--model", a.model, "--dtype", a.dtype, "--prompt-len", str(a.prompt_len),
           "--output-len", str(a.output_len), "--fill-mean", repr(a.fill_mean), "--fill-std", repr(a.fill_std)]
    commands = {"runs": cmd}
    print(f"running {', '.join(RUNS)} (one engine after another, one process) ...", flush=True)
    results = child_result(cmd, "the runs", timeout=a.timeout * len(RUNS), env=env)

    prompts = range(a.held_out)
    loads = {run: load(results[run]["counts"], prompts) for run in RUNS}
    ref = loads["prefill"]
    halves = (load(results["prefill"]["counts"], prompts[0::2]), load(results["prefill"]["counts"], prompts[1::2]))
    floor = [tv(x, y) for x, y in zip(*halves)]
    uniform = [tv(ref[layer], [1 / EXPERTS] * EXPERTS) for layer in range(LAYERS)]
    decode_tokens = sum(sum(results["prefill"]["counts"][i][0]) for i in prompts) // TOP_K
    rows = []
    for run in RUNS[1:]:
        per_layer = [tv(ref[layer], loads[run][layer]) for layer in range(LAYERS)]
        rows.append({"run": run, "tv_per_layer": per_layer, "tv_mean": sum(per_layer) / LAYERS,
                     "tokens_equal_to_prefill": equal_tokens(results["prefill"]["tokens"], results[run]["tokens"])})
    references = [{"run": "noise floor: prefill, half vs half", "tv_per_layer": floor, "tv_mean": sum(floor) / LAYERS},
                  {"run": "scale: prefill vs uniform load", "tv_per_layer": uniform, "tv_mean": sum(uniform) / LAYERS}]

    from kvfill.bench.common import table

    def show(r: dict) -> dict:
        shown = {"run": r["run"], "mean": f"{r['tv_mean']:.3f}",
                 "tokens_equal_to_prefill": r.get("tokens_equal_to_prefill", "")}
        shown.update({f"layer {layer}": f"{x:.3f}" for layer, x in enumerate(r["tv_per_layer"])})
        return shown

    print(f"\n{a.held_out} held-out prompts x {a.prompt_len} tokens, {a.output_len} greedy tokens "
          f"({decode_tokens} decode-step tokens per layer, top-{TOP_K} of {EXPERTS} experts); replay bank recorded over "
          f"{a.record} other prompts; model {os.path.basename(a.model)}, {a.dtype}")
    print("total variation distance of the decode-token expert load to real prefill's:")
    print(table([show(r) for r in rows + references],
                ["run"] + [f"layer {layer}" for layer in range(LAYERS)] + ["mean", "tokens_equal_to_prefill"]))

    import vllm

    path = os.path.abspath(a.json or os.path.join(here, "results", "moe-fidelity-cpu.json"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    payload = {
        "machine": {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "vllm": vllm.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python bench/moe_fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "record_command": record_cmd, "run_commands": commands,
        "args": {k: v for k, v in vars(a).items() if k not in ("only", "bank", "prompts_file")},
        "model_config": model_config(a.model),
        "prompts": {"held_out": a.held_out, "record": a.record, "prompt_len": a.prompt_len,
                    "output_len": a.output_len, "topic_words": TOPIC_WORDS, "record_seed": RECORD_SEED,
                    "held_out_seed": HELD_OUT_SEED, "decode_tokens_per_layer": decode_tokens,
                    "recorded_sequences_replayed": len(set(replayed))},
        "bank_kv_stats": stats,
        "fills": {"normal": {"fill_mean": a.fill_mean, "fill_std": a.fill_std},
                  "constant": {"fill_mean": FILL_MEAN, "fill_std": 0.0}},
        "rows": rows, "references": references,
        "expert_load": {run: [[round(x, 5) for x in row] for row in per_layer] for run, per_layer in loads.items()},
        "timings": {run: {"startup_s": results[run]["startup_s"], "generate_s": results[run]["generate_s"]}
                    for run in RUNS},
        "counts_per_prompt": {run: results[run]["counts"] for run in RUNS},  # [prompt][layer][expert]
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    text = json.dumps(payload, indent=1)
    # Lists of numbers on one line each: the counts are [prompt][layer][expert].
    text = re.sub(r"\[\s*([-+0-9.e,\s]+?)\s*\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    with open(path, "w") as f:
        f.write(text + "\n")
    png = path.removesuffix(".json") + ".png"
    try:
        plot(rows, loads, floor, png, f"tiny Mixtral ({LAYERS} layers, {EXPERTS} experts top-{TOP_K}): "
             f"{a.held_out} prompts x {a.prompt_len} tokens, {a.output_len} decode tokens, {a.dtype}")
        print(f"wrote {path} and {png}")
    except ImportError:
        print(f"wrote {path} (no matplotlib: pip install -e '.[bench]' for the plot)")
    print(f"wall {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
