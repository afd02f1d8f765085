"""Fidelity along prompt depth: what each synthetic fill does to speculative
acceptance, output lengths and tokens at the depths users benchmark, against
real prefill and replay, on both trained models up to their context.

    python bench/fidelity_depth.py --run                  # every model's check, then the table and plot
    python bench/fidelity_depth.py --run --models smollm2  # one model
    python bench/fidelity_depth.py                        # the table and plot from the stored reports

Per model one ``kvfill-check --depths`` run (``check/depths.py``) on real
long text (``bench/long_prompts.py``: Python source, prose documentation,
and a summary request around a document; ``--per-kind`` prompts of each,
every prompt cut to each depth, so depth is the only thing that changes),
greedy, EOS honoured (``--max-tokens``), ngram drafts (3 tokens, lookup
2-4), every fill kvfill-check compares.  SmolLM2-135M-Instruct runs to 7K
(its context is 8K, less the output), Gemma-3-270M base to 31K (its 32K,
less the output; 5 of 6 layers a 512-token window).  Gemma's deepest depth
is checked again on one prompt, in one check (``VARIANTS``, kvfill-check
``--also-replay``): replay from a host-kept bank, and from a bank of the
prompt's first half, written past its end as recorded (``past_bank=wrap``)
or re-rotated (``rotate``), each beside one real prefill.  Suffix decoding
is not in the study: vLLM 0.32's needs ``arctic_inference.suffix_decoding``,
whose only wheel on the index (0.0.4) lacks it (0.3.0 is a source archive
building a native extension).

Reports: ``bench/results/fidelity/check-depth-MODEL[-VARIANT]-cpu.*``; the
table goes into docs/fidelity.md between its depth markers, the curves into
``bench/results/fidelity/depth.png``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "fidelity")
WORK = os.path.join(ROOT, "out", "fidelity-depth")
DOC = os.path.join(ROOT, "docs", "fidelity.md")
BEGIN, END = "<!-- depth table: python bench/fidelity_depth.py -->", "<!-- end of the depth table -->"
FILLS = ("replay", "normal", "constant", "zeros")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
OUTPUT_LEN, MAX_TOKENS = 32, 128
# name -> (title, depths, the model's builder in kvfill.bench, its default folder's attribute)
MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct (dense, 8K)", "1k,2k,4k,7k", "real_model", "make_real_model"),
    "gemma": ("Gemma-3-270M base (512-token window on 5 of 6 layers, 32K)", "1k,4k,8k,16k,31k", "gemma_model",
              "make_gemma_model"),
}
# Gemma's deepest depth again, one prompt (the first: code), in one check of its own beside real prefill: replay
# of the first check's bank, the same bank kept in host memory (every row the prompt's: equal to real prefill,
# or a bug), and a bank of its first half only (kvfill-record --positions), past which replay writes that half
# again (wrap) or with its keys re-rotated to their true positions (rotate): how close each comes to real
# prefill is measured.  --also-replay run -> (the bank's share of the prompt, its settings)
VARIANTS = {"replay-host": (None, "bank_placement=host"), "replay-half-wrap": (0.5, "past_bank=wrap"),
            "replay-half-rotate": (0.5, "past_bank=rotate")}


def _model(name: str) -> str:
    import importlib

    _, _, module, builder = MODELS[name]
    return getattr(importlib.import_module(f"kvfill.bench.{module}"), builder)()


def _check(model: str, prompts: str, out: str, depths: str | None, extra: list[str], deepest: int = 0) -> int:
    """kvfill-check on ``prompts``, each cut to ``depths`` (None: the prompts as they are, the longest
    ``deepest`` tokens)."""
    from kvfill.check.depths import parse

    deepest = parse(depths)[-1][1] if depths else deepest
    cmd = [sys.executable, "-m", "kvfill.check", "--model", model, "--prompts", prompts, "--out", out,
           *(["--depths", depths] if depths else []), "--output-len", str(OUTPUT_LEN),
           "--max-tokens", str(MAX_TOKENS),
           "--time-passes", "0", "--max-model-len", str(deepest + MAX_TOKENS + 16),
           "--speculative-config", json.dumps(NGRAM), *extra]
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=False).returncode


def run(names: list[str], per_kind: int, variants: bool, kinds: list[str] | None = None) -> None:
    """Each model's check, then its variants, published into RESULTS."""
    from kvfill.bench.check_presets import publish
    from kvfill.bench.long_prompts import write
    from kvfill.check.depths import parse

    os.makedirs(WORK, exist_ok=True)
    for name in names:
        title, depths, _, _ = MODELS[name]
        model, t0 = _model(name), time.perf_counter()
        prompts = os.path.join(WORK, f"prompts-{name}.jsonl")
        write(prompts, tokens=parse(depths)[-1][1] + 1024, per_kind=per_kind, tokenizers=[model])
        if kinds:  # only these kinds' lines: a prefill pass costs minutes per 10K tokens on 2 cores (the sidecar
            # still names every line)
            with open(prompts) as f:
                lines = [line for line in f if json.loads(line)["class"] in kinds]
            with open(prompts, "w") as f:
                f.writelines(lines)
        out, kept = os.path.join(WORK, name), os.path.join(WORK, f"bank-{name}.safetensors")
        # an earlier run's recording of these prompts is replayed again, not recorded again (the recording is
        # a third of a check's time); the report says how many prompts it holds whole
        reuse = ["--bank", kept] if os.path.exists(kept) else []
        _check(model, prompts, out, depths, [*reuse, "--fills", *FILLS])
        if not reuse and os.path.exists(os.path.join(out, "bank.safetensors")):
            os.replace(os.path.join(out, "bank.safetensors"), kept)
        publish(out, RESULTS, f"depth-{name}")
        print(f"{name}: {time.perf_counter() - t0:.0f} s" + (f" (the recording {kept} reused)" if reuse else ""),
              flush=True)
        if name == "gemma" and variants and os.path.exists(kept):
            run_variants(model, kept, out, depths)


def run_variants(model: str, main_bank: str, out: str, depths: str) -> None:
    """``VARIANTS`` on the first prompt at the deepest depth (as the first
    check cut it): one check, its real prefill run once."""
    from kvfill.bench.check_presets import publish
    from kvfill.check.depths import parse

    label, deepest = parse(depths)[-1]
    with open(os.path.join(out, "logs", "depth-prompts.jsonl")) as f:
        first = next(line for line in f if json.loads(line)["class"].endswith(f".{label}"))
    one = os.path.join(WORK, "variant-prompt.jsonl")
    with open(one, "w") as f:
        f.write(first)
    half = os.path.join(WORK, "bank-half.safetensors")  # the prompt's first positions only, the check's flags
    cmd = [sys.executable, "-m", "kvfill.record", "--model", model, "--prompts", one, "--out", half,
           "--positions", str(deepest // 2), "--max-model-len", str(deepest + MAX_TOKENS + 16),
           "--enforce-eager", "--speculative-config", json.dumps(NGRAM)]
    print("$", " ".join(cmd), flush=True)
    if subprocess.run(cmd, check=False).returncode:
        return
    also = [f"{run}:" + ",".join([*([f"bank={half}"] if share else []), settings])
            for run, (share, settings) in VARIANTS.items()]
    vout = os.path.join(WORK, f"{os.path.basename(out)}-variants")
    # the prompt as the first check cut it (its class "code.<label>"), not cut again: a cut that moved back a few
    # tokens to a clean boundary is shorter than the depth
    _check(model, one, vout, None, ["--bank", main_bank, "--fills", "replay", "--also-replay", *also], deepest)
    publish(vout, RESULTS, f"depth-{os.path.basename(out)}-variants")


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def rows_of(report: str, title: str, data: dict) -> list[list]:
    """One row per depth and run: the run's figures at that depth beside real prefill's."""
    cmp = data.get("comparison") or {}
    # a variant's check ran on a prompt already cut (its class "KIND.DEPTH", no --depths): by class
    labels = data.get("prompt_depths") or data.get("prompt_classes") or []
    per = cmp.get("by_depth") or cmp.get("by_class") or {}
    prompts = {d: labels.count(d) for d in per}
    out = []
    for d, runs in per.items():
        ref = runs.get("prefill") or {}
        rs, re_ = ref.get("spec") or {}, ref.get("eos") or {}
        for run, row in runs.items():
            s, e, t = row.get("spec") or {}, row.get("eos") or {}, row.get("tokens")
            pos = " / ".join(_pct(a) for a in s.get("acceptance_per_position", ()))
            ref_pos = " / ".join(_pct(a) for a in rs.get("acceptance_per_position", ()))
            vs_acc = "" if run == "prefill" else f" vs {_pct(rs.get('acceptance'))}"
            out.append([title, d, run, "reference" if run == "prefill" else f"{t['equal']}/{t['total']}",
                        f"{_pct(s.get('acceptance'))}{vs_acc}",
                        pos + ("" if run == "prefill" else f" vs {ref_pos}"),
                        f"{s.get('tokens_per_step', '')}" + ("" if run == "prefill" else
                                                             f" vs {rs.get('tokens_per_step', '')}"),
                        f"{e.get('mean', '')}" + ("" if run == "prefill" else f" vs {re_.get('mean', '')}"
                                                  + (" (each =)" if row.get("eos_lengths_identical") else "")),
                        f"{prompts[d]} prompts, {s.get('drafts', 0)} drafts", report])
    return out


HEADER = ["model", "depth", "run", "tokens = real", "acceptance vs real", "per position vs real",
          "tokens/step vs real", "EOS mean length vs real", "sample", "report"]


def table() -> tuple[list[list], list[tuple[str, str, dict]], float]:
    rows, reports, seconds = [], [], 0.0
    for name, (title, _, _, _) in MODELS.items():
        for tag in ("", "-variants"):
            path = os.path.join(RESULTS, f"check-depth-{name}{tag}-cpu.json")
            if os.path.exists(path):
                data = json.load(open(path))
                rows += rows_of(os.path.basename(path)[:-5], title + (f" ({tag[1:]})" if tag else ""), data)
                reports.append((title, tag, data))
                seconds += data.get("runtime_s", 0.0)
    return rows, reports, seconds


def longest_first_token(data: dict) -> tuple[float, int] | None:
    """Real prefill's longest time to first token in its greedy pass (seconds from a request's first
    scheduling: its prefill, and the steps it shared with the others) and that prompt's tokens."""
    times = (data.get("steps") or {}).get("prefill", {}).get("first_token_s") or []
    got = [(t, n) for t, n in zip(times, data.get("prompt_tokens") or []) if t is not None]
    return max(got) if got else None


def plot(reports: list[tuple[str, str, dict]], path: str) -> bool:
    """Acceptance and EOS-honoured mean output length against depth, per model: every run on one axis."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from kvfill.check.report import depth_curves, draw_depth_curves

    main = [(title, data) for title, tag, data in reports if not tag]  # the variants' one depth draws no curve
    if not main:
        return False
    fig, axes = plt.subplots(len(main), 2, figsize=(9, 3.4 * len(main)), squeeze=False)
    for (title, data), row in zip(main, axes):
        for ax, (name, lines) in zip(row, depth_curves(data, data["comparison"])):
            draw_depth_curves(ax, f"{title}\n{name}", lines, data["depths"])
    fig.suptitle("kvfill-check --depths, ngram drafts, greedy (python bench/fidelity_depth.py)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="store_true", help="run each model's check first (minutes to hours on 2 cores)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--per-kind", type=int, default=1, help="prompts of each kind (code, prose, chat) per depth")
    p.add_argument("--kinds", nargs="+", choices=("code", "prose", "chat"), default=None,
                   help="--run: only these kinds of prompt (default: all three)")
    p.add_argument("--no-variants", dest="variants", action="store_false",
                   help="--run: not Gemma's host-kept / half-bank replays at its deepest depth")
    p.add_argument("--variants-only", action="store_true",
                   help="only Gemma's variants, from its stored check (out/fidelity-depth/gemma) and recording")
    a = p.parse_args(argv)
    if a.run:
        run(a.models, a.per_kind, a.variants, a.kinds)
    if a.variants_only:
        run_variants(_model("gemma"), os.path.join(WORK, "bank-gemma.safetensors"), os.path.join(WORK, "gemma"),
                     MODELS["gemma"][1])
    rows, reports, seconds = table()
    if not rows:
        print(f"no depth reports in {RESULTS} (python bench/fidelity_depth.py --run); {DOC} left as it is")
        return 0
    text = open(DOC).read()
    if BEGIN not in text or END not in text:
        print(f"{DOC} has no depth table markers ({BEGIN!r} ... {END!r})", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    body = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    body += ["| " + " | ".join(str(c).replace("|", "¦") for c in r) + " |" for r in rows]
    body += ["", f"The stored reports' runtimes add up to {seconds / 60:.0f} minutes on this host."]
    for title, tag, data in reports:
        longest = longest_first_token(data)
        if longest:
            body.append(f"{title}{f' ({tag[1:]})' if tag else ''}: real prefill's longest time to first token "
                        f"{longest[0]:.0f} s, a {longest[1]}-token prompt "
                        f"({len(data['prompt_tokens'])} prompt{'s' if len(data['prompt_tokens']) > 1 else ''} "
                        f"in the pass).")
    with open(DOC, "w") as f:
        f.write(head + BEGIN + "\n\n" + "\n".join(body) + "\n\n" + END + tail)
    drawn = plot(reports, os.path.join(RESULTS, "depth.png"))
    print(f"{DOC}: {len(rows)} depth rows{'; depth.png drawn' if drawn else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
