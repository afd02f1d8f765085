"""kvfill-check's one report writer: verdict lines, ``report.json``,
``report.md`` and ``report.png`` in ``--out``.

A verdict says, per fill and observable, whether the fill is real prefill's
equal, within real prefill's own floor, or distorted - and per fill whether
it is good enough for a decode benchmark.  What decides a benchmark's time:
output lengths where EOS is honoured (request throughput, the batch decode
runs at), speculative acceptance (tokens per step), MoE expert load (which
experts' weights each step reads) and a sparse-attention selector's top-k.
Greedy tokens say whether the fill is the prompt's context at all; a dense
model's decode with ``--ignore-eos`` and no drafter takes the same time
whatever they are.
"""
from __future__ import annotations

import json
import math
import os
import re

from .compare import REFERENCE

# A fill's expert-load TV within this many times real prefill's halves floor is noise: the floor is
# itself one draw of a noisy statistic (two halves of one sample), measured once.
MOE_NOISE = 1.5
# A floor this large against real prefill's distance to a uniform load: the sample cannot tell loads apart.
MOE_SCALE = 0.5
# A decode-time ratio beyond this, with no observable that explains it, is called out as a timing to rerun:
# time is reported, never judged (on 2 shared cores one run's ratio moves up to about 2x, docs/replay.md).
TIME_OFF = 1.5
# Per-token and per-prompt lists a run measured: in OUT/logs/RUN.json, summarised in report.json.
RAW = ("greedy", "eos", "expert_counts", "texts")  # --serve: the client's own file, OUT/logs/served-RUN.json


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def indexer_line(res: dict) -> str:
    """The sparse-attention indexer observable: never measured in an engine yet, and why."""
    if not res.get("indexer"):
        return "indexer top-k: not measured - the model has no sparse-attention indexer"
    return ("indexer top-k: not measured - vLLM CPU does not run sparse attention, and the check does not yet hook "
            "the indexer of a GPU engine; bench/indexer_scores.py measures each fill's top-k agreement on vLLM "
            "CPU's indexer ops")


def decoy_line(res: dict) -> str:
    """``--decoys``: how many prompt tokens each run found cached (vLLM's
    prefix-cache hits), in its engine and, with ``--serve``, on its server."""
    ran = {run: step for run, step in res["steps"].items() if run not in ("record", "prefill_split") and
           "error" not in step}
    hits = {run: step.get("counters", {}).get("prefix_cache_hit_tokens") for run, step in ran.items()}
    served = {f"{run} served": step["served"].get("prefix_cache_hit_tokens") for run, step in ran.items()
              if "served" in step}
    line = (f"prefix caching: after unrecorded decoys sharing each prompt's first {res['decoys']} tokens, cached "
            f"tokens reused - " + ", ".join(f"{run} {n}" for run, n in {**hits, **served}.items()))
    unused = [run for run, n in {**hits, **served}.items() if not n]
    return line + (f" (no reuse in {', '.join(unused)}: a block size above --decoys? nothing shown about reuse "
                   f"there)" if unused else "")


def token_verdict(run: str, row: dict) -> tuple[str, bool]:
    """The greedy-token line of a fill, and whether its tokens equal a
    reference's: the split reference's (a fill splits real prefill so on a
    model with recurrent state) where they do, else unsplit prefill's."""
    t = row["tokens"]
    split_t = row.get("tokens_vs_split", t)
    for ref, to in ((split_t, " split as the fill splits it" if split_t is not t else ""), (t, "")):
        if ref["identical"]:
            other = (f"; {split_t['equal']}/{split_t['total']} of the split reference's (vLLM's own prefill split "
                     f"there differs)" if ref is t and split_t is not t else "")
            return (f"{run}: greedy tokens = real prefill's{to} ({ref['equal']}/{ref['total']}, |Δlogprob| "
                    f"<= {ref['max_abs_logprob_diff']:g}){other}"), True
    firsts = [f for f in t["first_divergence"] if f is not None]
    return (f"{run}: {t['equal']}/{t['total']} greedy tokens as real prefill's ({_pct(t['share'])}), first divergence "
            f"at token {min(firsts)} (median {sorted(firsts)[len(firsts) // 2]}) - the model writes other text"), False


def verdicts(res: dict, cmp: dict) -> list[str]:
    """One line per fill and observable, then one summary line per fill."""
    if "reference_failed" in cmp:
        return [f"real prefill failed ({cmp['reference_failed']}): nothing to compare with"]
    lines, ref = [], cmp[REFERENCE]
    split = cmp.get("prefill_split")
    if split:
        t = split["tokens_vs_prefill"]
        what = "the split alone changes nothing here" if t["identical"] else "replay is held to the split"
        lines.append(f"split reference: real prefill split as a fill splits it keeps {t['equal']}/{t['total']} of "
                     f"unsplit prefill's greedy tokens ({what})")
    if res.get("decoys"):
        lines.append(decoy_line(res))
    if res["steps"][REFERENCE].get("served_error"):
        lines.append(f"prefill: served run failed - {res['steps'][REFERENCE]['served_error']}")
    lines += [f"{'prefill' if run == REFERENCE else run}: {note}" for run, step in res["steps"].items()
              for note in step.get("probe_notes", ())]
    for run, step in res["steps"].items():
        if run in ("record", REFERENCE, "prefill_split"):
            continue
        if "error" in step:
            lines.append(f"{run}: run failed - {step['error']}")
            continue
        row, timing, unknown = cmp[run], [], []
        if run == "replay" and res.get("bank_prompts_held") is not None and \
                res["bank_prompts_held"] < len(res["prompt_tokens"]):
            lines.append(f"replay: the bank holds {res['bank_prompts_held']}/{len(res['prompt_tokens'])} prompts "
                         f"whole; the others replay rows of its recorded sequences picked by each block's token hash "
                         f"(another text's KV), so their tokens need not be real prefill's")
        line, exact = token_verdict(run, row)
        lines.append(line)
        if "eos" in row and "eos" in ref:
            e, r, floor = row["eos"], ref["eos"], ref.get("eos_floor")
            d = abs(e["mean"] - r["mean"])
            what = (f"EOS-honoured output length {e['mean']:g} vs {r['mean']:g} real tokens, ending at EOS "
                    f"{_pct(e['eos_share'])} vs {_pct(r['eos_share'])}")
            if not (e["eos_share"] or r["eos_share"]):
                lines.append(f"{run}: no output of this run or real prefill's ended at EOS within --max-tokens "
                             f"{max(e['max'], r['max'])}: lengths say nothing here")
            elif row["eos_lengths_identical"]:
                lines.append(f"{run}: {what} - every length = real prefill's")
            elif floor is not None and d <= floor:
                lines.append(f"{run}: {what} - within real prefill's floor ({floor:g}: its halves' means)")
            else:
                lines.append(f"{run}: {what} (floor {floor if floor is not None else 'n/a'}) - request throughput "
                             f"will differ")
                timing.append("EOS lengths")
        s, rs, d = row.get("spec"), ref.get("spec"), row.get("drafts_equal")
        drafts = f"; drafts of {d['equal']}/{d['total']} steps as real prefill's" if d and d["total"] else ""
        if rs:
            if s is None:
                lines.append(f"{run}: no drafts counted vs acceptance {_pct(rs['acceptance'])} real")
                timing.append("acceptance")
            elif (s["accepted"], s["draft_tokens"]) == (rs["accepted"], rs["draft_tokens"]):
                lines.append(f"{run}: acceptance {_pct(s['acceptance'])}, {s['tokens_per_step']:g} tokens per step = "
                             f"real prefill's counters{drafts}")
            else:
                lines.append(f"{run}: acceptance {_pct(s['acceptance'])} vs {_pct(rs['acceptance'])} real, "
                             f"{s['tokens_per_step']:g} vs {rs['tokens_per_step']:g} tokens per step{drafts} - use replay")
                timing.append("acceptance")
        if "expert_load" in row and ref.get("moe_floor"):
            tv, floor = row["expert_load"]["tv_mean"], ref["moe_floor"]["tv_mean"]
            what = f"{run}: expert load TV {tv:.3f}, floor {floor:.3f}" + (f" ({tv / floor:.1f}x)" if floor else "")
            scale = ref["moe_floor"]["tv_to_uniform_mean"]
            if not any(row["expert_load"]["tv_per_layer"]):
                lines.append(f"{run}: expert load = real prefill's, every layer (TV 0)")
            elif exact and tv <= floor:  # the same tokens decoded: only rounding moves the router
                lines.append(f"{what} - within real prefill's noise: its greedy tokens are real prefill's, routed "
                             f"alike up to rounding")
            elif floor >= MOE_SCALE * scale:
                lines.append(f"{what} - inconclusive: real prefill's own halves differ as much as its load differs "
                             f"from a uniform one ({scale:.3f}); more prompts or --output-len")
                unknown.append("expert load inconclusive on this sample")
            elif tv <= MOE_NOISE * floor:
                lines.append(f"{what} - within real prefill's noise")
            else:
                lines.append(f"{what} - the fill moves MoE routing")
                timing.append("expert load")
        if step.get("probe_notes") or res["steps"][REFERENCE].get("probe_notes"):
            unknown.append("a probe could not read vLLM's model runner (above)")
        lines += served_lines(run, step, row, ref)
        if step.get("served_error") or res["steps"][REFERENCE].get("served_error"):
            unknown.append("EOS lengths not measured: a served run failed")
        if row.get("decode_time_ratio"):
            ratio = row["decode_time_ratio"]
            off = not timing and not 1 / TIME_OFF <= ratio <= TIME_OFF
            lines.append(f"{run}: decode {row['decode_ms_per_token']:g} ms per output token vs "
                         f"{ref['decode_ms_per_token']:g} real ({ratio:g}x)" + (
                             " - nothing measured above sets this fill's decode apart: one timing, on a shared "
                             "host noise; rerun before reading it as the fill's" if off else ""))
        if timing:
            verb = "differ" if len(timing) > 1 else "differs"
            lines.append(f"=> {run}: not valid for this benchmark ({', '.join(timing)} {verb}) - use replay")
        elif unknown:
            lines.append(f"=> {run}: not shown valid ({'; '.join(unknown)})")
        else:
            lines.append(f"=> {run}: valid for this benchmark - every observable that sets decode time is real "
                         f"prefill's or within its floor")
    if res.get("moe_note"):
        lines.append(f"expert load: {res['moe_note']}")
    lines.append(indexer_line(res))
    return lines


def served_lines(run: str, step: dict, row: dict, ref: dict) -> list[str]:
    """``--serve``: what the client measured, against real prefill's served run."""
    if step.get("served_error"):
        return [f"{run}: served run failed - {step['served_error']}"]
    if ref.get("served") is None and "served" in row:
        return [f"{run}: served, but real prefill's served run failed: nothing to compare with"]
    v, s, r = row.get("served_vs_real"), row.get("served"), ref.get("served")
    if not (v and s and r):
        return []
    rt = f" ({v['request_throughput_ratio']:g}x)" if v["request_throughput_ratio"] else ""
    tp = f" ({v['tpot_ratio']:g}x)" if v["tpot_ratio"] else ""
    es, er = row.get("eos_spec"), ref.get("eos_spec")
    acc = f"; served acceptance {_pct(es['acceptance'])} vs {_pct(er['acceptance'])} real" if es and er else ""
    return [f"{run}: served (vllm bench serve, concurrency {s['concurrency']}): {s['request_throughput']:.3g} "
            f"requests/s vs {r['request_throughput']:.3g} real{rt}, mean TPOT {s['mean_tpot_ms']:.3g} vs "
            f"{r['mean_tpot_ms']:.3g} ms{tp}{acc}; texts = real prefill's served texts {v['same_text']}/{v['texts']}"]


def write(out: str, cfg, res: dict, cmp: dict, lines: list[str]) -> list[str]:
    """report.json, report.md and report.png in ``out``; their paths."""
    paths = [os.path.join(out, f"report.{ext}") for ext in ("json", "md", "png")]
    steps = {run: {k: v for k, v in step.items() if k not in RAW} for run, step in res["steps"].items()}
    payload = {"command": ["kvfill-check", *cfg.argv], "model": cfg.model, "engine_flags": _jsonable(cfg.engine),
               "verdicts": lines, "comparison": cmp, **res, "steps": steps,
               "raw": {run: os.path.join(out, "logs", f"{run}.json") for run in steps if "error" not in steps[run]}}
    text = json.dumps(_finite(payload), indent=1, default=str, allow_nan=False)
    # lists of numbers on one line each (tokens, logprobs, expert counts)
    text = re.sub(r"\[\s*([-+0-9.e,\s]+?)\s*\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    with open(paths[0], "w") as f:
        f.write(text + "\n")
    with open(paths[1], "w") as f:
        f.write(markdown(cfg, res, cmp, lines))
    if "reference_failed" in cmp:
        paths[2] = "no report.png (real prefill failed: nothing to compare)"
    elif not plot(paths[2], res, cmp, os.path.basename(os.path.normpath(cfg.model))):
        paths[2] = "no report.png (matplotlib is not installed: pip install 'kvfill[bench]')"
    if paths[2].startswith("no ") and os.path.exists(os.path.join(out, "report.png")):
        os.remove(os.path.join(out, "report.png"))  # an earlier check's, beside this one's report
    return paths


def _finite(obj):
    """``obj`` with each NaN or infinite float as its name (strict JSON has no such number)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _jsonable(engine: dict) -> dict:
    return {k: v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v)
            for k, v in engine.items()}


def _held(res: dict) -> str:
    held = res.get("bank_prompts_held")
    return "" if held is None else f" (holding {held}/{len(res['prompt_tokens'])} prompts whole)"


def _eos_run(cfg) -> str:
    if not cfg.max_tokens:
        return "no EOS-honoured run (--max-tokens 0)"
    if cfg.serve:
        how = f"at temperature {cfg.temperature:g}" if cfg.temperature else "greedy"
        return (f"EOS-honoured run served (vllm serve + vllm bench serve, concurrency "
                f"{cfg.concurrency or 'every prompt'}) up to {cfg.max_tokens} tokens, {how}")
    how = f"at temperature {cfg.temperature:g}, each prompt its own seed" if cfg.temperature else "greedy"
    return f"EOS-honoured run up to {cfg.max_tokens} tokens, {how}"


def _runners(res: dict) -> str:
    """"; vLLM's model runner V2" (each run's, as its worker reported it; several when runs differ)."""
    seen = sorted({s["model_runner"] for s in res["steps"].values() if s.get("model_runner")})
    return f"; vLLM's model runner {' and '.join(seen)}" if seen else ""


def markdown(cfg, res: dict, cmp: dict, lines: list[str]) -> str:
    out = [f"# kvfill-check: {os.path.basename(os.path.normpath(cfg.model))}", "",
           f"`kvfill-check {' '.join(cfg.argv)}`", "",
           f"{len(res['prompt_tokens'])} prompts of {min(res['prompt_tokens'])}-{max(res['prompt_tokens'])} tokens; "
           f"{cfg.output_len} greedy tokens (EOS ignored); "
           f"{_eos_run(cfg)}; bank {'recorded over these prompts' if res['bank_recorded'] else res['bank']}"
           f"{_held(res)}"
           f"; {res['runtime_s']:.0f} s in all{_runners(res)}.", "", "## Verdicts", ""]
    out += [f"- {line}" for line in lines]
    served = " served req/s | served TPOT ms |" if cfg.serve else ""
    out += ["", "## Runs", "", "| run | tokens = real | EOS mean length | at EOS | acceptance | expert TV | "
            f"decode ms/token | run s |{served}", "|---|---|---|---|---|---|---|---|" + "---|---|" * cfg.serve]
    for run, step in res["steps"].items():
        if "error" in step:
            out.append(f"| {run} | failed | | | | | | {step.get('step_s', '')} |" + " | |" * cfg.serve)
            continue
        row = cmp.get(run, {})
        t = row.get("tokens") or row.get("tokens_vs_prefill")
        e, s = row.get("eos"), row.get("spec")
        tv = (row.get("expert_load") or {}).get("tv_mean", (row.get("moe_floor") or {}).get("tv_mean"))
        tok = f"{t['equal']}/{t['total']}" if t else ("reference" if run == REFERENCE else "")
        tv_cell = "" if tv is None else (f"floor {tv}" if run == REFERENCE else tv)
        out.append(f"| {run} | {tok} | {e['mean'] if e else ''} | {_pct(e['eos_share']) if e else ''} "
                   f"| {_pct(s['acceptance']) if s else ''} | {tv_cell} | {row.get('decode_ms_per_token') or ''} "
                   f"| {step.get('step_s', '')} |" + (_served_cells(step) if cfg.serve else ""))
    if res.get("samples"):
        out += ["", "## What each run wrote", "", "The first prompt's first greedy tokens:", "",
                "| run | text |", "|---|---|"]
        out += [f"| {run} | {json.dumps(text, ensure_ascii=False)[1:-1].replace('|', '¦')} |"
                for run, text in res["samples"].items()]
    return "\n".join(out) + "\n"


def _served_cells(step: dict) -> str:
    s = step.get("served")
    if s:
        return f" {s['request_throughput']:.3g} | {s['mean_tpot_ms']:.3g} |"
    return " failed | |" if step.get("served_error") else " | |"  # the recording and the split are not served


def plot(path: str, res: dict, cmp: dict, title: str) -> bool:
    """Tokens equal, EOS lengths, acceptance, expert TV, decode time per run; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = [r for r in res["steps"] if r not in ("record", "prefill_split") and r in cmp]
    panels = [("greedy tokens = real prefill's (%)",
               lambda r: 100.0 if r == REFERENCE else 100 * cmp[r]["tokens"]["share"])]
    if cmp.get(REFERENCE, {}).get("eos"):
        panels.append(("EOS-honoured mean output length", lambda r: (cmp[r].get("eos") or {}).get("mean", 0.0)))
    if cmp.get(REFERENCE, {}).get("spec"):
        panels.append(("acceptance (%)", lambda r: 100 * (cmp[r]["spec"] or {"acceptance": 0})["acceptance"]))
    if cmp.get(REFERENCE, {}).get("moe_floor"):
        panels.append(("expert load TV to real prefill (line: floor)",
                       lambda r: 0.0 if r == REFERENCE else cmp[r].get("expert_load", {}).get("tv_mean", 0.0)))
    if cmp.get(REFERENCE, {}).get("served"):
        panels.append(("served requests/s", lambda r: (cmp[r].get("served") or {}).get("request_throughput") or 0.0))
    panels.append(("decode ms per output token", lambda r: cmp[r].get("decode_ms_per_token") or 0.0))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), squeeze=False)
    for ax, (name, value) in zip(axes[0], panels):
        ax.bar(runs, [value(r) for r in runs], color=["tab:blue" if r == REFERENCE else "tab:orange"
                                                      if r == "replay" else "tab:gray" for r in runs])
        if name.startswith("expert"):
            ax.axhline(cmp[REFERENCE]["moe_floor"]["tv_mean"], color="k", ls="--", lw=1)
        ax.set_title(name, fontsize=8)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.suptitle(f"kvfill-check: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
