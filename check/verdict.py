"""kvfill-check's verdicts: per fill and observable one line naming its
sample, then one summary line per fill saying what it holds for.

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

from . import classes
from .compare import REFERENCE, REFERENCE_FAILED
from .setting_lines import decoy_line, indexer_line, run_coverage_lines

# A fill's expert-load TV within this many times real prefill's halves floor is noise: the floor is
# itself one draw of a noisy statistic (two halves of one sample), measured once.
MOE_NOISE = 1.5
# A floor this large against real prefill's distance to a uniform load: the sample cannot tell loads apart.
MOE_SCALE = 0.5
# A fill's decode-time interval must lie beyond this ratio (either way) to count as a difference: smaller
# effects than 10 % are below what a decode benchmark on a shared host resolves.  Real prefill timed against
# itself widens it where the host is noisier; past TIME_UNMEASURABLE the report says time is not measurable.
TIME_BAND = 1.1
TIME_UNMEASURABLE = 2.0
# Fewer timed passes a side than this: the interval is two or three draws wide, marked thin and not judged.
THIN_PASSES = 3
# Fewer prompts (reaching EOS) or MoE layers than this behind a verdict: marked thin.
THIN = 5
# Expert load: a sign test over at least SIGN_LAYERS layers, at level SIGN_P (below that many layers,
# no count of layers can reach SIGN_P: the mean TV decides, marked thin).
SIGN_LAYERS = 5
SIGN_P = 0.05


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


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
            return (f"{run}: greedy tokens = real prefill's{to} ({ref['equal']}/{ref['total']} over {ref['prompts']} "
                    f"prompts, |Δlogprob| <= {ref['max_abs_logprob_diff']:g}){other}"), True
    firsts = [f for f in t["first_divergence"] if f is not None]
    return (f"{run}: {t['equal']}/{t['total']} greedy tokens as real prefill's ({_pct(t['share'])}, {t['prompts']} "
            f"prompts), first divergence at token {min(firsts)} (median {sorted(firsts)[len(firsts) // 2]}) - the "
            f"model writes other text"), False


class Evidence:
    """What one fill's lines found, for its summary line: the observables
    measured (each with its sample), those that differ from real prefill's,
    those that could not be judged, and the runs a verdict holds only for."""

    def __init__(self):
        self.measured: list[str] = []
        self.differs: list[str] = []
        self.unknown: list[str] = []
        self.only_for: list[str] = []
        self.unmeasured: list[str] = []  # observables taken but too noisy or thin to judge: never "measured"

    def summary(self, run: str) -> str:
        if self.differs:
            verb = "differ" if len(self.differs) > 1 else "differs"
            return f"=> {run}: not valid for this benchmark ({', '.join(self.differs)} {verb}) - use replay"
        if self.unknown:
            return f"=> {run}: not shown valid ({'; '.join(self.unknown)})"
        on = f"; measured: {', '.join(self.measured)}" if self.measured else ""
        on += f"; not measurable here: {', '.join(self.unmeasured)}" if self.unmeasured else ""
        if self.only_for:
            return f"=> {run}: valid only for {'; '.join(self.only_for)}{on}"
        return (f"=> {run}: valid for this benchmark - every observable that sets decode time is real prefill's or "
                f"within its floor{on}")


def verdicts(res: dict, cmp: dict) -> list[str]:
    """One line per fill and observable, each naming its sample, then one
    summary line per fill saying what it holds for."""
    if "reference_failed" in cmp:
        skipped = [run for run, step in res["steps"].items() if step.get("error") == REFERENCE_FAILED]
        return [f"real prefill failed ({cmp['reference_failed']}): nothing to compare with"
                + (f"; not run: {', '.join(skipped)}" if skipped else "")]
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
    host, band = time_host_line(ref.get("decode_time"))
    lines += [host] if host else []
    lines += [note] if (note := classes.history_note(res.get("speculative_config"))) else []
    prompts = len(res["prompt_tokens"])
    for run, step in res["steps"].items():
        if run in ("record", REFERENCE, "prefill_split"):
            continue
        if "error" in step:
            lines.append(f"{run}: run failed - {step['error']}")
            continue
        row, ev = cmp[run], Evidence()
        lines += run_coverage_lines(res, run, prompts, ev)
        line, exact = token_verdict(run, row)
        lines.append(line)
        if exact:
            ev.measured.append(f"greedy tokens ({row['tokens']['prompts']} prompts)")
        lines += eos_lines(run, row, ref, res, ev)
        lines += spec_lines(run, row, ref, ev)
        lines += expert_lines(run, row, ref, exact, ev)
        if step.get("probe_notes") or res["steps"][REFERENCE].get("probe_notes"):
            ev.unknown.append("a probe could not read vLLM's model runner (above)")
        lines += served_lines(run, step, row, ref)
        if step.get("served_error") or res["steps"][REFERENCE].get("served_error"):
            ev.unknown.append("EOS lengths not measured: a served run failed")
        lines += time_lines(run, row.get("decode_time"), band, ev)
        lines += classes.class_lines(run, cmp, band, time_class, ev.differs)
        lines.append(ev.summary(run))
    if res.get("moe_note"):
        lines.append(f"expert load: {res['moe_note']}")
    lines.append(indexer_line(res))
    return lines


def _thin(n: int, what: str) -> str:
    return f"; thin: {n} {what}" if n < THIN else ""


def eos_lines(run: str, row: dict, ref: dict, res: dict, ev: Evidence) -> list[str]:
    """EOS-honoured lengths: equal, within real prefill's halves floor, or
    differing (request throughput and the batch decode runs at follow
    them); where no real output ended at EOS they say nothing, and a
    verdict holds only for EOS-ignored or capped runs."""
    if "eos" not in row or "eos" not in ref:
        if not (row.get("served_error") or ref.get("served_error")):
            ev.only_for.append("EOS-ignored runs (no EOS-honoured run: --max-tokens 0)")
        return []
    e, r, floor = row["eos"], ref["eos"], ref.get("eos_floor")
    n, at_eos = len(r["lengths"]), round(r["eos_share"] * len(r["lengths"]))
    cap = max(e["max"], r["max"])
    what = (f"EOS-honoured output length {e['mean']:g} vs {r['mean']:g} real tokens, ending at EOS "
            f"{_pct(e['eos_share'])} vs {_pct(r['eos_share'])} ({n} prompts, {at_eos} of real prefill's at EOS"
            f"{_thin(at_eos, 'at EOS')})")
    if not (r["eos_share"] or e["eos_share"]):
        ev.only_for.append(f"EOS-ignored runs or outputs capped at {cap} tokens (no real output ended at EOS: "
                           f"raise --max-tokens)")
        return [f"{run}: no output of this run or real prefill's ended at EOS within --max-tokens {cap}: lengths "
                f"say nothing here ({what})"]
    d = abs(e["mean"] - r["mean"])
    if row["eos_lengths_identical"]:
        ev.measured.append(f"EOS lengths ({n} prompts)")
        return [f"{run}: {what} - every length = real prefill's"]
    if floor is not None and d <= floor:
        ev.measured.append(f"EOS lengths ({n} prompts, within floor)")
        return [f"{run}: {what} - within real prefill's floor ({floor:g}: its halves' means)"]
    ev.differs.append("EOS lengths")
    return [f"{run}: {what} (floor {floor if floor is not None else 'n/a: one prompt'}) - request throughput "
            f"will differ"]


def spec_lines(run: str, row: dict, ref: dict, ev: Evidence) -> list[str]:
    s, rs, d = row.get("spec"), ref.get("spec"), row.get("drafts_equal")
    if not rs:
        return []
    # steps where neither side drafted are left out: nothing proposed on both sides is no agreement of drafts
    drafts = (f"; drafts as real prefill's on {d['equal']}/{d['total']} steps where either drafted ({d['neither']} "
              f"steps where neither drafted not counted)" if d and d.get("total") else "")
    if s is None:
        ev.differs.append("acceptance")
        return [f"{run}: no drafts counted vs acceptance {_pct(rs['acceptance'])} real ({rs['drafts']} drafts)"]
    if (s["accepted"], s["draft_tokens"]) == (rs["accepted"], rs["draft_tokens"]):
        ev.measured.append(f"acceptance ({rs['drafts']} drafts)")
        return [f"{run}: acceptance {_pct(s['acceptance'])}, {s['tokens_per_step']:g} tokens per step = real "
                f"prefill's counters ({rs['drafts']} drafts, {rs['draft_tokens']} draft tokens){drafts}"]
    ev.differs.append("acceptance")
    return [f"{run}: acceptance {_pct(s['acceptance'])} vs {_pct(rs['acceptance'])} real, {s['tokens_per_step']:g} "
            f"vs {rs['tokens_per_step']:g} tokens per step ({s['drafts']} vs {rs['drafts']} drafts){drafts} - "
            f"use replay"]


def expert_lines(run: str, row: dict, ref: dict, exact: bool, ev: Evidence) -> list[str]:
    """Expert load judged per layer: how many layers' TV exceed real
    prefill's own halves floor there, with a sign test over the layers
    (``compare.layers_against_floor``); too few prompts for a floor: not
    judged, and the fill not called valid."""
    if "expert_load" not in row:
        return []
    x, floor = row["expert_load"], ref.get("moe_floor")
    prompts = x["prompts"]
    if not any(x["tv_per_layer"]):
        ev.measured.append(f"expert load ({len(x['tv_per_layer'])} layers)")
        return [f"{run}: expert load = real prefill's, every layer (TV 0, {len(x['tv_per_layer'])} layers, "
                f"{prompts} prompts)"]
    if not floor:
        ev.unknown.append(f"expert load not judged: {prompts} prompt(s), and real prefill's floor needs 2 or more")
        return [f"{run}: expert load TV {x['tv_mean']:.3f} - not judged: real prefill's own floor needs 2 or more "
                f"prompts ({prompts} here)"]
    tv, f_mean, n, k = x["tv_mean"], floor["tv_mean"], x["layers"], x["layers_above_floor"]
    sample = (f"{k}/{n} layers above real prefill's floor there, {x['layers_above_1_5x_floor']} above 1.5x; "
              f"sign test p {x['sign_p_more']:.2g}; {prompts} prompts{_thin(n, 'layers: a sign test needs 5')}")
    what = f"{run}: expert load TV {tv:.3f}, floor {f_mean:.3f}" + (f" ({tv / f_mean:.1f}x)" if f_mean else "")
    scale = floor["tv_to_uniform_mean"]
    if exact and tv <= f_mean:  # the same tokens decoded: only rounding moves the router
        ev.measured.append(f"expert load ({n} layers)")
        return [f"{what} ({sample}) - within real prefill's noise: its greedy tokens are real prefill's, routed "
                f"alike up to rounding"]
    if n >= SIGN_LAYERS and x["sign_p_more"] < SIGN_P:
        ev.differs.append("expert load")
        return [f"{what} ({sample}) - the fill moves MoE routing in most layers"]
    if f_mean >= MOE_SCALE * scale:
        ev.unknown.append("expert load inconclusive on this sample")
        return [f"{what} ({sample}) - inconclusive: real prefill's own halves differ as much as its load differs "
                f"from a uniform one ({scale:.3f}); more prompts or --output-len"]
    if tv > MOE_NOISE * f_mean:
        ev.differs.append("expert load")
        return [f"{what} ({sample}) - the fill moves MoE routing"]
    if n >= SIGN_LAYERS and x["sign_p_less"] >= SIGN_P and k > n / 2:
        ev.unknown.append("expert load inconclusive on this sample")
        return [f"{what} ({sample}) - inconclusive: most layers above the floor, too few to tell"]
    ev.measured.append(f"expert load ({n} layers)")
    return [f"{what} ({sample}) - within real prefill's noise"]


def time_host_line(t: dict | None) -> tuple[str | None, float]:
    """Real prefill timed against itself (its passes of one parity over the
    other's): how finely this host resolves decode time now.  The line, and
    the band a fill's interval must clear to count as a difference: at
    least ``TIME_BAND``, wider where real prefill's own interval is."""
    if not t or "ratio" not in t:
        return None, TIME_BAND
    lo, hi = t["interval"]
    band = max(TIME_BAND, hi, 1 / lo)
    host = (f"load {t['load'][0]:g}-{t['load'][1]:g} on {t['cores']} cores, {_cpu(t)} with {t['torch_threads']} torch "
            f"threads")
    line = (f"decode time on this host: real prefill against itself {t['ratio']:g}x [{lo:g}, {hi:g}] "
            f"({t['passes'][0]}+{t['passes'][1]} passes, {t['steps'][0]}+{t['steps'][1]} steps at batch "
            f"{t['batch']}; {host})")
    if band > TIME_UNMEASURABLE:
        return (line + f" - decode time is not measurable on this host now: its own passes differ by up to "
                       f"{band:.2g}x; every ratio below is not measurable here unless beyond that"), band
    if band > TIME_BAND:
        return line + f" - a fill's time counts as different only beyond {band:.2g}x", band
    return line, band


def _cpu(t: dict) -> str:
    """CPU seconds per wall second over the timed passes: the process's and its engine thread's."""
    thread = t.get("thread_cpu_per_wall")
    return f"{t['cpu_per_wall']:g} CPU s per wall s" + (f" ({thread:g} in the engine's thread)" if thread is not None
                                                         else "")


def _ms(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"


def time_lines(run: str, t: dict | None, band: float, ev: Evidence) -> list[str]:
    """A fill's decode time against real prefill's passes interleaved with
    it in its engine: different where its interval lies wholly beyond the
    host's band; within what the host resolves where it lies wholly inside
    the band; else - an interval reaching past the band (whether or not it
    holds 1: it admits a difference the host could have seen), a host that
    resolves nothing now (band past ``TIME_UNMEASURABLE``), or fewer than
    ``THIN_PASSES`` passes a side - not measurable here, and never counted
    as measured."""
    if t is None:
        ev.only_for.append("what was measured besides decode time (not timed: --time-passes 0, or the engine's "
                           "steps could not be timed)")
        return []
    if "ratio" not in t:
        ev.unknown.append(f"decode time not measured: {t['error']}")
        return [f"{run}: decode time not measured - {t['error']}"]
    lo, hi = t["interval"]
    fill, real = t["ms_per_token"]
    passes = min(t["passes"])
    what = (f"{run}: decode {fill:.3g} vs {real:.3g} ms per request-token of real prefill interleaved in the same "
            f"engine: {t['ratio']:g}x [{lo:g}, {hi:g}] ({t['passes'][0]}+{t['passes'][1]} passes"
            f"{'; thin' if passes < THIN_PASSES else ''}, {t['steps'][0]}+{t['steps'][1]} steps at batch "
            f"{t['batch']}; pass medians {_ms(t['pass_medians'][0])} vs {_ms(t['pass_medians'][1])} ms; load "
            f"{t['load'][0]:g}-{t['load'][1]:g}, {_cpu(t)})")
    gained = t.get("tokens_per_step")
    if gained and gained[0] != gained[1]:  # a drafter's acceptance moves time per token, not per step
        what += (f"; per step {t['step_ratio']:g}x, requests gaining {gained[0]:g} vs {gained[1]:g} tokens a step: "
                 f"the difference is acceptance's")
    kind, why = time_class(t, band)
    if kind == "differs":
        ev.differs.append("decode time")
        return [f"{what} - {why}"]
    if kind == "unmeasurable":
        ev.unmeasured.append(f"decode time ({why})")
        return [f"{what} - not measurable here: {why}"]
    ev.measured.append(f"decode time ({t['passes'][0]}+{t['passes'][1]} passes, within {band:.2g}x)")
    return [f"{what} - {why}"]


def time_class(t: dict, band: float) -> tuple[str, str]:
    """A timed ratio judged against the host's ``band``: ``("differs" |
    "within" | "unmeasurable", why)`` - thin first (fewer than
    ``THIN_PASSES`` passes a side: two or three draws, whatever the
    interval), then wholly beyond the band, wholly within it, or else
    reaching past it (or a host that resolves nothing now)."""
    lo, hi = t["interval"]
    passes = min(t["passes"])
    if passes < THIN_PASSES:
        return "unmeasurable", f"thin: {passes} timed passes a side, fewer than {THIN_PASSES}"
    if lo > band or hi < 1 / band:
        return "differs", f"{'slower' if lo > 1 else 'faster'} than real prefill beyond this host's noise ({band:.2g}x)"
    if band > TIME_UNMEASURABLE:
        return "unmeasurable", f"this host resolves nothing finer than {band:.2g}x now"
    if hi > band or lo < 1 / band:
        return "unmeasurable", (f"the interval reaches past the {band:.2g}x this host resolves: it admits a "
                                f"difference as large")
    return "within", f"within {band:.2g}x: below what this host resolves"


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


