"""What each synthetic fill gets wrong, per mechanism: one table from
kvfill-check runs, each model family at two prompt depths.

    python bench/fidelity.py --run     # every family's check (bench/check_presets.py), then the table
    python bench/fidelity.py           # the table and plot again from the reports already in bench/results/fidelity

Each family is one ``bench/check_presets.py`` run whose prompts carry their
depth as their class (``--classes``; the MoE preset's topic prompts have
one length, so it runs once per depth), with every fill kvfill-check
compares - constant (0.015: the in-tree ``DecodeBenchConnector``'s default
fill), normal (the bank's own mean and std: the in-tree connector's fill
with ``fill_std`` set, kvfill's values), zeros, replay - against real
prefill.  Per family, depth and fill, the signed error of every observable
the check measured: greedy tokens as real prefill's, decode time per
request-token (the ratio to real prefill's passes interleaved in the same
engine, minus 1, with its 95 % interval; "n.m." where the interval reaches
past what the host resolves), acceptance and tokens per step (drafters),
EOS-honoured output length (the trained model: the tiny random ones reach
no EOS), expert load (layers above real prefill's floor) and, for
DeepSeek's sparse-attention indexer, top-k overlap through vLLM's own
readers (``bench/indexer_scores.py``'s report).  Writes docs/fidelity.md's
table (between its markers) and bench/results/fidelity/fidelity.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "fidelity")
DOC = os.path.join(ROOT, "docs", "fidelity.md")
INDEXER = os.path.join(HERE, "results", "indexer-scores-cpu.json")
BEGIN, END = "<!-- fidelity table: python bench/fidelity.py -->", "<!-- end of the fidelity table -->"
FILLS = ("constant", "normal", "zeros", "replay")


def _depths(a: int, b: int, n: int = 3) -> list[str]:
    return ["--lens", *[str(a)] * n, *[str(b)] * n, "--classes", *[f"d{a}"] * n, *[f"d{b}"] * n]


# (report name, family, check_presets arguments)
FAMILIES = [
    ("real-fidelity", "dense, trained (SmolLM2-135M) + ngram drafts",
     ["real", *_depths(300, 600), "--tag", "fidelity"]),
    ("sliding-fidelity", "sliding window 256 + full attention (tiny Gemma3)",
     ["sliding", *_depths(150, 400, 2), "--tag", "fidelity"]),
    ("moe-d64", "MoE (tiny Mixtral), 64-token prompts",
     ["moe", "--held-out", "32", "--record", "16", "--prompt-len", "64", "--tag", "d64"]),
    ("moe-d256", "MoE (tiny Mixtral), 256-token prompts",
     ["moe", "--held-out", "32", "--record", "16", "--prompt-len", "256", "--tag", "d256"]),
    ("hybrid-fidelity", "hybrid: gated delta-net (tiny Qwen3-Next)",
     ["hybrid", *_depths(100, 250, 2), "--tag", "fidelity", "--", "--fills", *FILLS]),
    ("hybrid-mamba2-fidelity", "hybrid: Mamba-2",
     ["hybrid", "--kind", "mamba2", *_depths(100, 250, 2), "--tag", "fidelity", "--", "--fills", *FILLS]),
    ("spec-fidelity", "spec: draft model (the tiny Llama for itself)", ["spec", *_depths(100, 250, 2), "--tag",
                                                                         "fidelity"]),
    ("spec-eagle-fidelity", "spec: EAGLE head (random)", ["spec", "--drafter", "eagle", *_depths(100, 250, 2),
                                                          "--tag", "fidelity"]),
    ("spec-mtp-fidelity", "spec: MTP layer (tiny MiMo)", ["spec", "--drafter", "mtp", *_depths(100, 250, 2),
                                                          "--tag", "fidelity"]),
]


def run_all(names: list[str]) -> None:
    """Each family's check, one after another, published into RESULTS."""
    for name, _, args in FAMILIES:
        if names and name not in names:
            continue
        own, extra = (args[:args.index("--")], args[args.index("--"):]) if "--" in args else (args, [])
        cmd = [sys.executable, os.path.join(HERE, "check_presets.py"), *own, "--results", RESULTS, *extra]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=False)


def _pct(x: float) -> str:
    return f"{100 * x:+.0f} %"


def _time(t: dict | None, band: float) -> str:
    """A decode-time ratio as a signed error with its interval and what it shows."""
    from kvfill.check.verdict import time_class

    if not t or "ratio" not in t:
        return "not timed"
    kind, _ = time_class(t, band)
    shows = {"differs": "differs", "within": "within"}.get(kind, "n.m.")
    return (f"{_pct(t['ratio'] - 1)} [{_pct(t['interval'][0] - 1)}, {_pct(t['interval'][1] - 1)}] {shows} "
            f"({t['passes'][0]}+{t['passes'][1]} passes)")


def _spec(row: dict, ref: dict) -> tuple[str, str]:
    s, r = row.get("spec"), ref.get("spec")
    if not r:
        return "", ""
    if not s:  # the fill's drafter proposed nothing: one token a step
        return (f"{-100 * r['acceptance']:+.0f} pp (no drafts vs {r['accepted']}/{r['draft_tokens']})",
                f"{1 - r['tokens_per_step']:+.2f}")
    return (f"{100 * (s['acceptance'] - r['acceptance']):+.0f} pp ({s['accepted']}/{s['draft_tokens']} vs "
            f"{r['accepted']}/{r['draft_tokens']})", f"{s['tokens_per_step'] - r['tokens_per_step']:+.2f}")


def _eos(row: dict, ref: dict) -> str:
    e, r = row.get("eos"), ref.get("eos")
    if not e or not r:
        return "no EOS run"
    same = " (each =)" if row.get("eos_lengths_identical") else ""
    return f"{e['mean'] - r['mean']:+.1f} tokens ({e['mean']:g} vs {r['mean']:g}){same}"


def _experts(row: dict) -> str:
    x = row.get("expert_load")
    if not x or "layers_above_floor" not in x:
        return ""
    return f"{x['layers_above_floor']}/{x['layers']} layers above floor (TV {x['tv_mean']:g})"


def rows_of(name: str, family: str, data: dict) -> list[list]:
    """The table's rows of one report: per depth (class, or the report's one depth) and fill."""
    from kvfill.check.classes import class_band
    from kvfill.check.verdict import time_host_line

    cmp = data["comparison"]
    if "reference_failed" in cmp:
        return [[family, "", "", f"real prefill failed: {cmp['reference_failed']}", *[""] * 6, name, None]]
    _, band = time_host_line(cmp["prefill"].get("decode_time"))
    per = cmp.get("by_class") or {f"d{max(data['prompt_tokens'])}": {run: cmp[run] for run in cmp if run in
                                                                   ("prefill", *FILLS)}}
    out = []
    for depth, runs in per.items():
        ref = runs.get("prefill", {})
        for fill in FILLS:
            row = runs.get(fill)
            if row is None:
                err = data["steps"].get(fill, {}).get("error")
                out.append([family, depth, fill, f"not run: {err}" if err else "not run", *[""] * 6, name, None])
                continue
            t = row.get("tokens") or {}
            tok = f"{t.get('equal')}/{t.get('total')}"
            split = row.get("tokens_vs_split")  # a hybrid: real prefill split as the fill splits it
            if split:
                tok += f" (vs the split reference: {split['equal']}/{split['total']})"
            elif cmp.get(fill, {}).get("tokens_vs_split"):  # a report from before the split per class
                split = cmp[fill]["tokens_vs_split"]
                tok += f" (all depths vs the split reference: {split['equal']}/{split['total']})"
            acc, tps = _spec(row, ref)
            prompts = row.get("prompts") or t.get("prompts")
            out.append([family, depth, fill, tok,
                        _time(row.get("decode_time"), class_band(ref, band) if "by_class" in cmp else band),
                        acc, tps, _eos(row, ref), _experts(cmp.get(fill, {})) if depth == next(iter(per)) else "",
                        f"{prompts} prompts", name, row.get("decode_time")])
    return out


def indexer_rows() -> list[list]:
    """Top-k overlap of the sparse-attention indexer, through vLLM's own readers (indexer_scores.py)."""
    if not os.path.exists(INDEXER):
        return []
    data = json.load(open(INDEXER))
    return [["DSA indexer (vLLM's CPU reader, no engine)", f"d{r['positions']}", r["fill"],
             "", "", "", "", "", f"top-k overlap {_pct(r['topk_overlap_writer'] - 1)} ({r['topk_overlap_writer']:g})",
             "one layer's logits", os.path.basename(INDEXER), None] for r in data["rows"] if r["fill"] in FILLS]


HEADER = ["family", "depth", "fill", "tokens = real", "decode time vs real [95 %]", "acceptance vs real",
          "tokens/step vs real", "EOS length vs real", "expert load / top-k", "sample", "report"]


def table() -> tuple[list[list], list[str]]:
    """Every report's rows (the table's cells, then the row's decode time for the plot) and the families not run."""
    rows, missing = [], []
    for name, family, _ in FAMILIES:
        path = os.path.join(RESULTS, f"check-{name}-cpu.json")
        if not os.path.exists(path):
            missing.append(name)
            continue
        rows += rows_of(f"check-{name}-cpu", family, json.load(open(path)))
    return rows + indexer_rows(), missing


def markdown(rows: list[list], missing: list[str]) -> str:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(str(c).replace("|", "¦") for c in r[:len(HEADER)]) + " |" for r in rows]
    if missing:
        out += ["", f"Not run yet: {', '.join(missing)} (`python bench/fidelity.py --run`)."]
    return "\n".join(out)


def plot(rows: list[list], path: str) -> bool:
    """Decode-time error per family, depth and fill, with its interval."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    timed = []
    for r in rows:
        t = r[-1]  # the row's decode time, as compare.decode_time gave it
        if not t or "ratio" not in t:
            continue
        mid, lo, hi = (100 * (x - 1) for x in (t["ratio"], *t["interval"]))
        short = r[10].removeprefix("check-").removesuffix("-cpu").replace("-fidelity", "")
        timed.append((f"{short} {r[1]} {r[2]}", mid, lo, hi, r[2]))
    if not timed:
        return False
    colors = {"constant": "tab:red", "normal": "tab:orange", "zeros": "tab:purple", "replay": "tab:green"}
    fig, ax = plt.subplots(figsize=(9, max(3, 0.22 * len(timed))))
    for i, (label, mid, lo, hi, fill) in enumerate(timed):
        ax.errorbar(mid, i, xerr=[[mid - lo], [hi - mid]], fmt="o", color=colors.get(fill, "k"), capsize=2)
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yticks(range(len(timed)), [t[0] for t in timed], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("decode time per request-token vs real prefill (%), 95 % interval; CPU host")
    ax.set_title("What each fill does to decode time (python bench/fidelity.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="store_true", help="run every family's check first (about an hour on 2 cores)")
    p.add_argument("--only", nargs="+", default=[], metavar="NAME", help="--run: only these families "
                   f"({', '.join(n for n, _, _ in FAMILIES)})")
    a = p.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    if a.run:
        run_all(a.only)
    rows, missing = table()
    text = open(DOC).read()
    if BEGIN not in text or END not in text:
        print(f"{DOC} has no table markers ({BEGIN!r} ... {END!r})", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(DOC, "w") as f:
        f.write(head + BEGIN + "\n\n" + markdown(rows, missing) + "\n\n" + END + tail)
    drawn = plot(rows, os.path.join(RESULTS, "fidelity.png"))
    print(f"{DOC}: {len(rows)} rows ({len(missing)} families not run){'; fidelity.png drawn' if drawn else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
