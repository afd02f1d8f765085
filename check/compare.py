"""kvfill-check's one comparison: each fill's run against real prefill's, per
observable, with real prefill's own floor where a sample has one.

  * tokens: greedy tokens equal to real prefill's, position by position up to
    each prompt's first difference; that first difference; the largest
    |logprob difference| over the tokens that agree.  A hybrid model's fills
    are also compared with the split reference (``prefill_split``).
  * eos: the EOS-honoured outputs' lengths (mean, quartiles, share ending at
    EOS); floor: the difference of real prefill's mean length over the even
    and over the odd prompts.
  * spec: vLLM's speculative-decoding counters of the greedy run; acceptance
    (accepted / draft tokens) and tokens per step over every decode step a
    request ran, drafted or not (``tokens_per_step``: an ngram drafter that
    finds no match proposes nothing, and that step still gains its token).
  * expert load: per MoE layer, the normalised histogram of the experts
    decode-step tokens were routed to, and its total variation distance
    ``TV(p, q) = 1/2 sum |p_e - q_e|`` to real prefill's; floor: the TV
    between real prefill's loads over two halves of the prompts (the even
    and the odd ones: half the sample each: about sqrt 2 above a full-size comparison's noise).
  * time (``decode_time``): milliseconds per request-token of the pure
    decode steps at the largest batch both sides ran, a fill's passes over
    the real-prefill passes interleaved with them in the same engine (real
    prefill's own run: its passes of one parity over the other's, the
    host's noise); the ratio of the pooled medians with a 95 % interval from
    a two-level bootstrap (passes, then steps within each pass).
  * served (``--serve``): the EOS-honoured outputs are the served ones; the
    client's request throughput and mean TPOT as ratios to real prefill's
    served run, and how many served texts equal its.
"""
from __future__ import annotations

import itertools
import math
import random
import statistics

from . import classes

REFERENCE = "prefill"
REFERENCE_FAILED = "not run: real prefill failed"  # the error of each step after a failed real prefill
BOOTSTRAP = 2000  # resamples behind a decode-time interval


def tokens(ref: list[dict], rows: list[dict]) -> dict:
    equal = total = identical = 0
    worst = 0.0
    first = []
    for r, o in zip(ref, rows):
        total += len(r["tokens"])
        same = 0
        for tr, to, lr, lo in zip(r["tokens"], o["tokens"], r["logprobs"], o["logprobs"]):
            if tr != to:
                break
            same += 1
            worst = max(worst, abs(lr - lo))
        equal += same
        identical += same == len(r["tokens"])
        first.append(None if same == len(r["tokens"]) else same)
    return {"equal": equal, "total": total, "share": round(equal / total, 4) if total else None,
            "prompts_identical": identical, "prompts": len(ref), "first_divergence": first,
            "max_abs_logprob_diff": round(worst, 5), "identical": equal == total}


def lengths(rows: list[dict]) -> dict:
    n = [r["length"] for r in rows]
    q = statistics.quantiles(n, n=4) if len(n) > 1 else n * 3
    return {"lengths": n, "mean": round(statistics.fmean(n), 2), "p25": q[0], "median": q[1], "p75": q[2],
            "max": max(n), "eos_share": round(sum(r["eos"] for r in rows) / len(rows), 4)}


def halves_floor(values: list[float]) -> float | None:
    """|mean over the even prompts - mean over the odd ones| of real prefill's per-prompt values."""
    if len(values) < 2:
        return None
    return round(abs(statistics.fmean(values[0::2]) - statistics.fmean(values[1::2])), 3)


def tokens_per_step(gained: int, accepted: int, steps: int | None = None, drafts: int = 0) -> float:
    """Tokens a request gains per decode step it ran, drafted or not:
    ``gained`` (the tokens the requests gained after their first step) over
    their request-steps.  ``steps``: those counted (a timer's pure decode
    steps; None: not counted).  vLLM's counters bound them from below, and
    the largest bound is taken: every draft (``drafts``) was a request-step,
    and a request-step gains one token plus the draft tokens it accepted,
    so at least gained - ``accepted`` ran (a step mixing in another prompt's
    prefill chunk is not timed, but counted so).  Where every step is
    counted that is 1 + accepted / request-steps by vLLM's counters, but for
    a last draft's tokens past max_tokens, which vLLM counts accepted and no
    request gains.  Never 1 + accepted / drafts: that is per *drafted* step,
    and with an ngram drafter most steps draft nothing.  At least 1: each
    step gains a token (below 1 the counters are not these tokens')."""
    ran = max(steps or 0, drafts, gained - accepted)
    return max(1.0, gained / ran) if ran > 0 else 1.0


def spec(counters: dict, gained: int, steps: int | None = None) -> dict | None:
    """Acceptance and tokens per step of vLLM's ``counters`` over requests
    that gained ``gained`` tokens after their first (``tokens_per_step``)."""
    drafts, draft_tokens = counters.get("num_drafts", 0), counters.get("num_draft_tokens", 0)
    if not draft_tokens:
        return None
    accepted = counters.get("num_accepted_tokens", 0)
    out = {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted,
           "acceptance": round(accepted / draft_tokens, 4),
           "tokens_per_step": round(tokens_per_step(gained, accepted, steps, drafts), 3)}
    per_pos = counters.get("num_accepted_tokens_per_pos")
    if per_pos and drafts:  # vLLM's per-position counter: of the drafts, the share whose k-th token was accepted
        out["acceptance_per_position"] = [round(a / drafts, 4) for a in per_pos]
    return out


def drafts_equal(ref: list[dict], rows: list[dict]) -> dict | None:
    """Steps where real prefill or the fill drafted, and of those the ones
    whose drafts are equal (None: drafts not watched).  A step where neither
    drafted (``neither``) is no agreement: an ngram drafter finding nothing
    on both sides says nothing of the KV.  A request whose steps do not pair
    up (its tokens differ) has no step equal."""
    if "drafts" not in ref[0] or "drafts" not in rows[0]:
        return None
    same = total = neither = 0
    for r, o in zip(ref, rows):
        mine = o.get("drafts", [])
        paired = len(r["drafts"]) == len(mine)
        for x, y in itertools.zip_longest(r["drafts"], mine, fillvalue=[]):
            if not (x or y):
                neither += 1
                continue
            total += 1
            same += paired and x == y
    return {"equal": same, "total": total, "neither": neither}


def load(counts: list, prompts) -> list[list[float]]:
    """Normalised expert load per layer, summed over ``prompts``."""
    out = []
    for layer in range(len(counts[0])):
        total = [sum(counts[p][layer][e] for p in prompts) for e in range(len(counts[0][layer]))]
        n = sum(total)
        out.append([x / n if n else 0.0 for x in total])
    return out


def tv(p: list[float], q: list[float]) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q))


def expert_load(ref: list, counts: list) -> dict:
    every = range(len(ref))
    per_layer = [round(tv(p, q), 4) for p, q in zip(load(ref, every), load(counts, every))]
    return {"tv_per_layer": per_layer, "tv_mean": round(statistics.fmean(per_layer), 4), "prompts": len(counts)}


def moe_floor(ref: list) -> dict | None:
    if len(ref) < 2:
        return None
    every = range(len(ref))
    per_layer = [round(tv(p, q), 4) for p, q in zip(load(ref, every[0::2]), load(ref, every[1::2]))]
    uniform = [round(tv(p, [1 / len(p)] * len(p)), 4) for p in load(ref, range(len(ref)))]
    return {"tv_per_layer": per_layer, "tv_mean": round(statistics.fmean(per_layer), 4),
            "tv_to_uniform_mean": round(statistics.fmean(uniform), 4)}


def layers_against_floor(tv: list[float], floor: list[float]) -> dict:
    """How many layers' TV exceed real prefill's floor in that layer, and a
    sign test of that count (each layer a fair coin if the fill routes as a
    fresh sample of real prefill does; the halves floor is the larger of the
    two under that, so the test leans to "within"): ``p_more`` = P(at least
    this many), ``p_less`` = P(at most this many)."""
    n, k = len(tv), sum(t > f for t, f in zip(tv, floor))
    above = sum(t > 1.5 * f for t, f in zip(tv, floor))
    pmf = [math.comb(n, i) / 2 ** n for i in range(n + 1)]
    return {"layers": n, "layers_above_floor": k, "layers_above_1_5x_floor": above,
            "sign_p_more": round(sum(pmf[k:]), 4), "sign_p_less": round(sum(pmf[:k + 1]), 4)}


def compare_all(res: dict) -> dict:
    """Per fill, every observable against real prefill (and the split
    reference); real prefill's own figures and floors under ``prefill``."""
    steps = res["steps"]
    ref = steps.get(REFERENCE, {})
    if "error" in ref or not ref:
        return {"reference_failed": ref.get("error", "not run")}
    out = {REFERENCE: _own(ref)}
    out[REFERENCE]["eos_floor"] = halves_floor([r["length"] for r in ref["eos"]]) if ref["eos"] else None
    if "expert_counts" in ref:
        out[REFERENCE]["moe_floor"] = moe_floor(ref["expert_counts"])
    split = steps.get("prefill_split")
    for run, got in steps.items():
        if run in (REFERENCE, "record", "prefill_split") or "error" in got:
            continue
        row = {**_own(got), "tokens": tokens(ref["greedy"], got["greedy"]),
               "drafts_equal": drafts_equal(ref["greedy"], got["greedy"])}
        if split and "error" not in split:
            row["tokens_vs_split"] = tokens(split["greedy"], got["greedy"])
        if "expert_counts" in got and "expert_counts" in ref:
            row["expert_load"] = expert_load(ref["expert_counts"], got["expert_counts"])
            floor = out[REFERENCE].get("moe_floor")
            if floor:
                row["expert_load"].update(layers_against_floor(row["expert_load"]["tv_per_layer"],
                                                               floor["tv_per_layer"]))
        if ref["eos"] and got.get("eos"):
            row["eos_lengths_identical"] = [r["length"] for r in got["eos"]] == [r["length"] for r in ref["eos"]]
        if got.get("served") and ref.get("served"):
            row["served_vs_real"] = served(ref, got)
        out[run] = row
    if split and "error" not in split:
        out["prefill_split"] = {"tokens_vs_prefill": tokens(ref["greedy"], split["greedy"])}
    for name, key in (("by_class", "prompt_classes"), ("by_depth", "prompt_depths")):
        per = by_class(res, key)
        if per:
            out[name] = per
    return out


def by_class(res: dict, key: str = "prompt_classes") -> dict | None:
    """Class -> run -> its figures on that class's prompts alone
    (``classes.py``); None without classes.  ``key``: the result's list
    of each prompt's class (``prompt_depths``: every class of one depth
    together, ``--depths``)."""
    per = classes.groups(res.get(key))
    if not per:
        return None
    steps = res["steps"]
    ref, split = steps[REFERENCE], steps.get("prefill_split")
    whole = halves_floor([r["length"] for r in ref["eos"]]) if ref.get("eos") else None
    out: dict[str, dict] = {}
    for c, idx in per.items():
        runs: dict[str, dict] = {}
        for run, got in steps.items():
            if run in ("record", "prefill_split") or "error" in got or "greedy" not in got:
                continue
            rows = [got["greedy"][i] for i in idx]
            eos = [got["eos"][i] for i in idx] if got.get("eos") else []
            row = {"prompts": len(idx), "spec": spec(classes.counted(rows), _gained(rows)),
                   "eos": lengths(eos) if eos else None,
                   "decode_time": decode_time((got.get("timing_by_class") or {}).get(c))}
            if run == REFERENCE:  # a class's EOS lengths are judged by the whole run's floor, as the run's are
                row["eos_floor"] = whole if eos else None
            else:
                row["tokens"] = tokens([ref["greedy"][i] for i in idx], rows)
                if split and "greedy" in split:  # a hybrid's reference: real prefill split as a fill splits it
                    row["tokens_vs_split"] = tokens([split["greedy"][i] for i in idx], rows)
                if eos and ref.get("eos"):
                    row["eos_lengths_identical"] = [r["length"] for r in eos] == [ref["eos"][i]["length"] for i in idx]
            runs[run] = row
        out[c] = runs
    return out


def _gained(rows: list[dict]) -> int:
    """Tokens the greedy requests gained after their first step (their decode steps')."""
    return sum(len(r["tokens"]) - 1 for r in rows)


def decode_time(timing: dict | None) -> dict | None:
    """A run's timed passes (``measure.time_passes``) as one ratio with its
    interval: the first kind's ms per request-token (a step's time over the
    tokens each request gained in it) over the second kind's, at the
    largest batch both ran pure decode steps at (a drafter's runs finish
    requests at different steps).  Beside it each kind's pass medians, the
    host's load and CPU seconds per wall second: the process's (every torch
    thread) and the engine's own thread's.  None
    without passes; ``error`` when no batch size is common to both."""
    passes = (timing or {}).get("passes")
    if not passes:
        return None
    kinds = list(dict.fromkeys(p["kind"] for p in passes))
    groups = {k: [p for p in passes if p["kind"] == k] for k in kinds}
    common = set.intersection(*({b for p in ps for b in p["batch"]} for ps in groups.values()))
    if len(kinds) != 2 or not common:
        return {"kinds": kinds, "error": "no pure decode steps at a batch size both kinds of pass ran"}
    batch = max(common)
    per = {k: [[ms / p["tokens_per_step"] for ms, b in zip(p["ms"], p["batch"]) if b == batch] for p in ps]
           for k, ps in groups.items()}
    per = {k: [steps for steps in v if steps] for k, v in per.items()}
    a, b = kinds
    med = {k: statistics.median([x for steps in per[k] for x in steps]) for k in kinds}
    raw = {k: statistics.median([ms for p in ps for ms, b in zip(p["ms"], p["batch"]) if b == batch])
           for k, ps in groups.items()}  # per step, whatever each request gained in it
    gained = {k: round(statistics.fmean(p["tokens_per_step"] for p in ps), 3) for k, ps in groups.items()}
    lo, hi = _interval(per[a], per[b])
    return {"kinds": kinds, "batch": batch, "ms_per_token": [round(med[a], 4), round(med[b], 4)],
            "ratio": round(med[a] / med[b], 3), "interval": [round(lo, 3), round(hi, 3)],
            "step_ratio": round(raw[a] / raw[b], 3), "tokens_per_step": [gained[a], gained[b]],
            "passes": [len(per[a]), len(per[b])], "steps": [sum(map(len, per[a])), sum(map(len, per[b]))],
            "pass_medians": [[round(statistics.median(s), 3) for s in per[k]] for k in kinds],
            "load": [min(min(p["load"]) for p in passes), max(max(p["load"]) for p in passes)],
            "cpu_per_wall": round(sum(p["cpu_s"] for p in passes) / sum(p["wall_s"] for p in passes), 2),
            "thread_cpu_per_wall": round(sum(p["thread_cpu_s"] for p in passes) / sum(p["wall_s"] for p in passes), 2),
            "torch_threads": timing.get("torch_threads"), "cores": timing.get("cores")}


def _interval(a: list[list[float]], b: list[list[float]]) -> tuple[float, float]:
    """95 % interval of median(a) / median(b), each side resampled in two
    levels (its passes, then the steps of each pass drawn): a burst of load
    that slowed one pass widens it, as it should, instead of moving it."""
    rng = random.Random(0)

    def draw(passes):
        pooled = []
        for steps in rng.choices(passes, k=len(passes)):
            pooled += rng.choices(steps, k=len(steps))
        return statistics.median(pooled)

    ratios = sorted(draw(a) / draw(b) for _ in range(BOOTSTRAP))
    return ratios[int(0.025 * BOOTSTRAP)], ratios[int(0.975 * BOOTSTRAP) - 1]


def served(ref: dict, got: dict) -> dict:
    """``--serve``: the client's request throughput and mean TPOT as ratios to
    real prefill's served run, and the texts served equal to its."""
    def ratio(key):
        mine = got["served"].get(key)
        return round(mine / ref["served"][key], 3) if ref["served"].get(key) and mine is not None else None

    texts = list(zip(ref.get("texts", []), got.get("texts", [])))
    return {"request_throughput_ratio": ratio("request_throughput"), "tpot_ratio": ratio("mean_tpot_ms"),
            "same_text": sum(a == b for a, b in texts), "texts": len(texts)}


def _own(got: dict) -> dict:
    """A run's own figures."""
    greedy = got.get("greedy") or []
    watched = classes.counted(greedy)  # from the drafts: each request-step gains 1 + the tokens it accepted
    steps = _gained(greedy) - watched["num_accepted_tokens"] if watched else None
    row = {"decode_time": decode_time(got.get("timing")), "spec": spec(got.get("counters", {}), _gained(greedy), steps),
           "eos_spec": spec(got.get("eos_counters", {}), sum(r["length"] - 1 for r in got.get("eos") or []))}
    if got.get("eos"):
        row["eos"] = lengths(got["eos"])
    if got.get("served"):
        row["served"] = got["served"]
    if "expert_counts" in got:
        row["expert_load_per_layer"] = load(got["expert_counts"], range(len(got["expert_counts"])))
    return row
