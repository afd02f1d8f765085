"""What each synthetic fill gets wrong, per mechanism: one table from
kvfill-check runs, each model family at two prompt depths.

    python bench/fidelity.py --run     # every family's check (bench/check_presets.py), then the table
    python bench/fidelity.py           # the table and plot again from the reports already in bench/results/fidelity
    python bench/fidelity.py --rejudge REPORT.json ...   # stored reports judged again by today's code

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
import re
import subprocess
import sys
from types import SimpleNamespace

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

    if t and "stored" in t:  # not recomputable (rejudge): the stored figure, named with the code that judged it
        old = t["stored"]
        return (f"not recomputed: {_pct(old['ratio'] - 1)} [{_pct(old['interval'][0] - 1)}, "
                f"{_pct(old['interval'][1] - 1)}] as {t['judged_by']}'s code judged it over tokens per drafted step "
                f"(its passes are not stored)")
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


def _eos(row: dict, ref: dict, cap: int) -> str:
    """The EOS mean length's error and the lengths stopped at --max-tokens (a mean over those is a floor)."""
    e, r = row.get("eos"), ref.get("eos")
    if not e or not r:
        return "no EOS run"
    same = " (each =)" if row.get("eos_lengths_identical") else ""
    at = [sum(n >= cap for n in x["lengths"]) for x in (e, r)]
    capped = f"; at the {cap} cap: {at[0]}/{len(e['lengths'])} vs {at[1]}/{len(r['lengths'])} real" if any(at) else ""
    return f"{e['mean'] - r['mean']:+.1f} tokens ({e['mean']:g} vs {r['mean']:g}{capped}){same}"


def _experts(row: dict) -> str:
    x = row.get("expert_load")
    if not x or "layers_above_floor" not in x:
        return ""
    return f"{x['layers_above_floor']}/{x['layers']} layers above floor (TV {x['tv_mean']:g})"


def rows_of(name: str, family: str, data: dict) -> list[list]:
    """The table's rows of one report: per depth (class, or the report's one depth) and fill."""
    from kvfill.check.classes import class_band
    from kvfill.check.verdict import THIN, time_host_line

    cmp = data["comparison"]
    if "reference_failed" in cmp:
        return [[family, "", "", f"real prefill failed: {cmp['reference_failed']}", *[""] * 6, name, None]]
    _, band = time_host_line(cmp["prefill"].get("decode_time"))
    whole = {run: cmp[run] for run in cmp if run in ("prefill", *FILLS)}
    per = cmp.get("by_class") or {f"d{max(data['prompt_tokens'])}": whole}
    if any("stored" in (r.get("decode_time") or {}) for runs in per.values() for r in runs.values()):
        per = {**per, "all depths": whole}  # the whole run's passes are stored: its figures are recomputed
    cap = _args(data).max_tokens
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
            thin = f" (thin: under {THIN})" if prompts < THIN else ""
            out.append([family, depth, fill, tok,
                        _time(row.get("decode_time"), band if runs is whole else class_band(ref, band)),
                        acc, tps, _eos(row, ref, cap), _experts(cmp.get(fill, {})) if depth == next(iter(per)) else "",
                        f"{prompts} prompts{thin}", name, row.get("decode_time")])
    return out


def indexer_rows() -> list[list]:
    """Top-k overlap of the sparse-attention indexer, through vLLM's own readers (indexer_scores.py)."""
    if not os.path.exists(INDEXER):
        return []
    data = json.load(open(INDEXER))
    return [["DSA indexer (vLLM's CPU reader, no engine)", f"d{r['positions']}", r["fill"],
             "", "", "", "", "", f"top-k overlap {_pct(r['topk_overlap_writer'] - 1)} ({r['topk_overlap_writer']:g})",
             "one layer's logits", os.path.basename(INDEXER), None] for r in data["rows"] if r["fill"] in FILLS]


def _args(data: dict):
    """The check's own options as the report's command gave them (kvfill-check's parser)."""
    from kvfill.check.cli import build_parser
    from kvfill.record.cli import parse
    return parse(build_parser(), data["command"][1:])[0]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _pass(p: dict, tokens: int, counters: dict) -> bool:
    """A stored timed pass with its tokens, request-steps and vLLM's counts, its tokens per step over every
    step.  One stored with 1 + accepted / drafts alone: its accepted tokens are the run's greedy counters'
    where they give that figure (the same prompts, greedy), none where it is 1; else False."""
    from kvfill.check.compare import tokens_per_step

    if "tokens" not in p:
        acc, drafts, old = counters.get("num_accepted_tokens", 0), counters.get("num_drafts", 0), p["tokens_per_step"]
        if not (drafts and round(1 + acc / drafts, 4) == old):
            if old != 1:
                return False
            acc = drafts = 0  # nothing accepted; its drafts only bound its steps from below, as 0 does
        p.update(tokens=tokens, request_steps=sum(p["batch"]), accepted=acc, drafts=drafts,
                 tokens_per_drafted_step=old)
    p["tokens_per_step"] = round(tokens_per_step(p["tokens"], p["accepted"], p["request_steps"], p["drafts"]), 4)
    return True


def rejudge(path: str) -> list[str]:
    """A stored kvfill-check report's figures, verdicts, report.md and .png
    again by today's code from what it stores (not its per-token logs):
    each timed pass (``_pass``), decode times, acceptance, the per-class
    figures (``check/rejudge.py``).  What cannot be recomputed is marked
    with the commit that stored it; returns what."""
    from kvfill.check import compare, rejudge, report, verdict

    data = json.load(open(path))
    cmp, steps, lost = data["comparison"], data["steps"], []
    mark = data.setdefault("rejudged", {"stored_by": _git("log", "-1", "--format=%h", "--", path)})
    args, n = _args(data), len(data["prompt_tokens"])
    gained = n * (args.output_len - 1)  # EOS ignored: every request's output_len tokens, the first from its prefill
    for run, step in steps.items():
        row, passes = cmp.get(run), (step.get("timing") or {}).get("passes", [])
        if row is None or "error" in step:
            continue
        if not all([_pass(p, gained, (step if p["kind"] == "fill" else steps["prefill"]).get("counters", {}))
                    for p in passes]):  # said, never judged again
            row["decode_time"] = {"error": f"not recomputed: {mark['stored_by']}'s passes hold no accepted tokens"}
            lost.append(f"{run}'s decode time")
        elif passes:
            row["decode_time"] = compare.decode_time(step["timing"])
        row["spec"] = compare.spec(step.get("counters", {}), gained)
        lengths = (row.get("eos") or {}).get("lengths", [])
        row["eos_spec"] = compare.spec(step.get("eos_counters", {}), sum(x - 1 for x in lengths))
        if row.get("drafts_equal") and "neither" not in row["drafts_equal"]:
            row["drafts_equal"] = None  # counted steps where neither drafted; the drafts are in the logs
            lost.append(f"{run}'s drafts step by step")
    lost += rejudge.rejudge(cmp, args.output_len, mark["stored_by"])
    lost = mark["not_recomputed"] = list(dict.fromkeys(mark.get("not_recomputed", []) + lost))  # and a rerun's
    mark["by"] = _git("rev-parse", "--short", "HEAD")
    data["verdicts"] = lines = [
        f"re-judged from this report's stored figures by bench/fidelity.py --rejudge at {mark['by']} (tokens per step "
        f"over every decode step, not per drafted step); stored by {mark['stored_by']}"
        + (f"; not recomputable from what is stored: {', '.join(lost)}" if lost else "")] + verdict.verdicts(data, cmp)
    text = json.dumps(data, indent=1, allow_nan=False)
    with open(path, "w") as f:  # as report.write lays it out: a list of numbers on one line
        f.write(re.sub(r"\[\s*([-+0-9.e,\s]+?)\s*\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n")
    with open(path[:-len(".json")] + ".md", "w") as f:
        f.write(report.markdown(SimpleNamespace(**vars(args), argv=data["command"][1:]), data, cmp, lines))
    report.plot(path[:-len(".json")] + ".png", data, cmp, os.path.basename(os.path.normpath(args.model)))
    return lost


def run_seconds() -> float:
    """The stored reports' runtimes together: what ``--run`` took."""
    paths = [os.path.join(RESULTS, f"check-{name}-cpu.json") for name, _, _ in FAMILIES]
    return sum(json.load(open(p))["runtime_s"] for p in paths if os.path.exists(p))


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
    p.add_argument("--run", action="store_true", help=f"run every family's check first (about "
                   f"{run_seconds() / 60:.0f} minutes on 2 cores: the stored reports' runtimes add up so)")
    p.add_argument("--rejudge", nargs="+", default=[], metavar="REPORT", help="stored kvfill-check reports (.json) "
                   "judged again by today's code from their stored figures (rejudge), before the table")
    p.add_argument("--only", nargs="+", default=[], metavar="NAME", help="--run: only these families "
                   f"({', '.join(n for n, _, _ in FAMILIES)})")
    a = p.parse_args(argv)
    os.makedirs(RESULTS, exist_ok=True)
    if a.run:
        run_all(a.only)
    for path in a.rejudge:
        lost = rejudge(path)
        print(f"{path}: re-judged" + (f"; not recomputable: {', '.join(lost)}" if lost else ""))
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
