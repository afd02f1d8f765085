"""kvfill-check by prompt class: a ``.jsonl`` prompts file may give each
prompt a ``"class"`` (code, prose, chat, a depth...;
``record.inputs.read_prompt_classes``), and every fill's figures that a
class moves on a GPU are then reported per class as well as in all
(``compare.by_class``; the lines and the report's table here):

* acceptance and tokens per step of a drafter, per request from the drafts
  each step proposed and the tokens the request got (greedy: a draft's
  accepted tokens are the longest prefix of it the request's next tokens
  equal), summed over the class - in all, these are vLLM's own counters
  but for a draft reaching past a request's last token (``accepted``);
* greedy tokens as real prefill's, and the EOS-honoured output lengths
  (mean, and whether each equals real prefill's);
* decode time, where the run was timed: each class's prompts timed apart
  (``measure.time_passes`` over that class alone, the same interleaving of
  the fill with real prefill), judged by ``verdict.time_class`` against the
  host's band, wider where real prefill against itself on that class was
  noisier (``class_band``).

A fill's verdict names the classes where it differs.  Some drafters propose
from the run's history, not only from the KV: suffix decoding's tree grows
with every output the server generated, and vLLM 0.34's ``fly``
(lossy) and ``synthetic`` rejection samplers accept by a rule that is not
greedy equality - replay makes the KV equal, not that history, so
acceptance there is compared, never promised equal (``history_note``).
"""
from __future__ import annotations

import itertools

# Drafting methods whose proposals read the run's history (vLLM's speculative_config "method").
HISTORY_METHODS = {"suffix": "suffix decoding proposes from a tree of the outputs the engine generated before"}
# vLLM 0.34's rejection_sample_method values whose acceptance is not greedy equality with the target's tokens.
REJECTION_NOTES = {
    "fly": "rejection_sample_method 'fly' accepts by FLy's lossy, entropy-gated window, not by equality",
    "synthetic": "rejection_sample_method 'synthetic' accepts at the configured rates, whatever the KV",
}


def groups(classes: list[str] | None) -> dict[str, list[int]]:
    """Class -> the indices of its prompts, classes in order of first use ({} without classes)."""
    out: dict[str, list[int]] = {}
    for i, c in enumerate(classes or ()):
        out.setdefault(c, []).append(i)
    return out


def _verified(tokens: list[int], drafts: list[list[int]]):
    """Each verified draft of one greedy request as ``(accepted, length)``:
    each step's draft (after the first token) checked against the tokens
    that followed (``accepted``'s rule)."""
    pos = 1  # tokens the request holds when its first draft is verified
    for d in drafts:
        if pos >= len(tokens):
            break
        if not d:
            pos += 1
            continue
        m = 0
        while m < len(d) and pos + m < len(tokens) and d[m] == tokens[pos + m]:
            m += 1
        yield m, len(d)
        pos += m + 1


def accepted(tokens: list[int], drafts: list[list[int]]) -> tuple[int, int, int]:
    """``(accepted, draft tokens, drafts)`` of one greedy request: each
    step's draft (after the first token) checked against the tokens that
    followed.  A step without a draft (an ngram drafter that found no match)
    still gains its one token; a draft proposed once the request had all its
    tokens was never verified and is not counted.  A draft reaching past
    the request's last token counts only the tokens it can be checked on:
    vLLM's counter may count the rest accepted, so a sum of these is at most
    one draft per request below it (drafts and draft tokens are equal)."""
    acc = drafted = n = 0
    for m, length in _verified(tokens, drafts):
        acc, drafted, n = acc + m, drafted + length, n + 1
    return acc, drafted, n


def accepted_per_position(tokens: list[int], drafts: list[list[int]]) -> list[int]:
    """How many of one greedy request's verified drafts had their k-th token
    accepted, for each draft position k (vLLM's
    ``num_accepted_tokens_per_pos``): a draft accepting m tokens counts at
    positions 0..m-1."""
    out: list[int] = []
    for m, length in _verified(tokens, drafts):
        out += [0] * (length - len(out))
        for k in range(m):
            out[k] += 1
    return out


def counted(rows: list[dict]) -> dict:
    """vLLM's speculative-decoding counters as ``rows``' drafts and tokens
    give them (``accepted`` per request; {} where drafts were not watched):
    what ``compare.spec`` reads."""
    if not rows or any("drafts" not in r for r in rows):
        return {}
    acc, drafted, n = (sum(x) for x in zip(*(accepted(r["tokens"], r["drafts"]) for r in rows)))
    per_pos: list[int] = []
    for r in rows:
        mine = accepted_per_position(r["tokens"], r["drafts"])
        per_pos = [a + b for a, b in itertools.zip_longest(per_pos, mine, fillvalue=0)]
    return {"num_drafts": n, "num_draft_tokens": drafted, "num_accepted_tokens": acc,
            "num_accepted_tokens_per_pos": per_pos}


def spec_differs(row: dict, ref: dict) -> bool:
    """Whether a class's acceptance under a fill is not real prefill's."""
    s, r = row.get("spec"), ref.get("spec")
    return bool(s and r and (s["accepted"], s["draft_tokens"]) != (r["accepted"], r["draft_tokens"]))


def class_band(ref: dict, band: float) -> float:
    """The band a class's decode-time ratio must clear: the host's
    (``verdict.time_host_line``), wider where real prefill timed against
    itself on that class's prompts alone was noisier."""
    t = ref.get("decode_time")
    if not t or "interval" not in t:
        return band
    lo, hi = t["interval"]
    return max(band, hi, 1 / lo)


def class_lines(run: str, cmp: dict, band: float, time_class, differs_out: list) -> list[str]:
    """A fill's lines per class: its greedy tokens, acceptance, EOS lengths
    and decode time against real prefill's on the same class, and the
    classes where it differs (``time_class``: the verdict's judgement of a
    timed ratio), each also put in ``differs_out`` (the fill's summary).
    Tokens that differ are named apart, as the whole run's are: other text
    sets decode time only through the observables judged beside it."""
    per = cmp.get("by_class")
    if not per:
        return []
    lines, differs, other = [], {}, {}
    for c, runs in per.items():
        row, ref = runs.get(run), runs.get("prefill")
        if row is None or ref is None:
            continue
        what, why = [], []
        t = _class_tokens(row)
        if t:
            split = " split as the fill splits it" if t is row.get("tokens_vs_split") else ""
            what.append(f"greedy tokens {t['equal']}/{t['total']} as real prefill's{split}")
            if not t["identical"]:
                other[c] = f"{t['equal']}/{t['total']}"
        s, r = row.get("spec"), ref.get("spec")
        if s and r:
            what.append(f"acceptance {s['acceptance']:.0%} vs {r['acceptance']:.0%} ({s['accepted']}/"
                        f"{s['draft_tokens']} vs {r['accepted']}/{r['draft_tokens']} draft tokens)")
            if spec_differs(row, ref):
                why.append("acceptance")
        elif r:  # the fill's drafter proposed nothing on this class: one token a step
            what.append(f"no drafts vs acceptance {r['acceptance']:.0%} ({r['accepted']}/{r['draft_tokens']})")
            why.append("acceptance")
        e, re_ = row.get("eos"), ref.get("eos")
        if e and re_:
            eos, differ = _class_eos(e, re_, row.get("eos_lengths_identical"), ref.get("eos_floor"))
            what.append(eos)
            why += ["EOS lengths"] if differ else []
        t = row.get("decode_time")
        if t and "ratio" in t:
            kind, _ = time_class(t, class_band(ref, band))
            what.append(f"decode {t['ratio']:g}x [{t['interval'][0]:g}, {t['interval'][1]:g}] "
                        f"({'n.m.' if kind == 'unmeasurable' else kind})")
            if kind == "differs":
                why.append("decode time")
        elif t:  # no ratio: said, never judged
            what.append(f"decode time not judged ({t['error']})")
        if what:
            lines.append(f"{run}, class {c} ({row['prompts']} prompts): {'; '.join(what)}")
        if why:
            differs[c] = why
    differs_out += [f"class {c} ({', '.join(w)})" for c, w in differs.items()]
    if differs:
        lines.append(f"{run}: differs from real prefill in class{'es' if len(differs) > 1 else ''} "
                     + "; ".join(f"{c} ({', '.join(w)})" for c, w in differs.items()))
    if other:
        lines.append(f"{run}: greedy tokens differ from real prefill's in class{'es' if len(other) > 1 else ''} "
                     + ", ".join(f"{c} ({x})" for c, x in other.items()) + " - the model writes other text there"
                     + ("" if differs else "; in no class do the other figures measured differ from real "
                                           "prefill's"))
    elif lines and not differs:
        lines.append(f"{run}: no class differs from real prefill in what was measured per class")
    return lines


def _class_tokens(row: dict) -> dict | None:
    """A class's greedy tokens against the reference the whole run's line
    uses: the split reference's where they equal it, else unsplit prefill's."""
    split = row.get("tokens_vs_split")
    return split if split and split["identical"] else row.get("tokens")


def _class_eos(e: dict, r: dict, same: bool | None, floor: float | None) -> tuple[str, bool]:
    """A class's EOS mean length against real prefill's, judged as the whole
    run's is: every length equal, else within the whole run's floor (real
    prefill's halves over every prompt), else differing."""
    what = f"EOS mean length {e['mean']:g} vs {r['mean']:g}"
    if same:
        return what + " (each equal)", False
    if floor is not None and abs(e["mean"] - r["mean"]) <= floor:
        return what + f", within real prefill's floor ({floor:g})", False
    return what + f" (floor {floor if floor is not None else 'n/a: one prompt'})", True


def history_note(spec_config: dict | None) -> str | None:
    """A line naming a drafter whose proposals depend on the run's history
    (module docstring), with what replay can and cannot make equal."""
    if not spec_config:
        return None
    method = str(spec_config.get("method") or "")
    notes = []
    if method in HISTORY_METHODS:
        notes.append(HISTORY_METHODS[method])
    rejection = str(spec_config.get("rejection_sample_method") or "standard")  # vLLM 0.34's samplers
    if rejection in REJECTION_NOTES:
        notes.append(REJECTION_NOTES[rejection])
    if not notes:
        return None
    return ("speculative decoding: " + "; ".join(notes) + " - replay makes the prompt's KV equal, not that "
            "history, so acceptance can differ from real prefill's for reasons no fill controls")


def class_table(cmp: dict, band: float, time_class, key: str = "by_class") -> list[str]:
    """The report's table by prompt class (none without classes), or with
    ``key`` "by_depth" by depth (``--depths``: every class of one depth)."""
    per = cmp.get(key)
    if not per:
        return []
    depth = key == "by_depth"
    out = ["", "## By depth" if depth else "## By prompt class", "",
           ("Each depth's prompts (every prompt cut to its first D tokens) on their own" if depth else
            "Each class's prompts on their own") +
           ": greedy tokens as real prefill's, EOS-honoured mean length (= "
           "where every length equals real prefill's), acceptance, acceptance per draft position (of the drafts, "
           "the share whose k-th token was accepted) and tokens per step from each request's "
           "drafts, decode time of the class's prompts timed apart (ratio to real prefill [95 %], and what it "
           "shows against the host's band).", "",
           f"| {'depth' if depth else 'class'} | run | prompts | tokens = real | EOS mean length | acceptance "
           "| per position | tokens/step | decode ratio [95 %] |",
           "|---|---|---|---|---|---|---|---|---|"]
    for c, runs in per.items():
        for run, row in runs.items():
            t, e, s, d = row.get("tokens"), row.get("eos"), row.get("spec"), row.get("decode_time")
            tok = f"{t['equal']}/{t['total']}" if t else "reference"
            eos = f"{e['mean']:g}{' =' if row.get('eos_lengths_identical') else ''}" if e else ""
            acc = f"{s['acceptance']:.0%} ({s['accepted']}/{s['draft_tokens']})" if s else ""
            tps = f"{s['tokens_per_step']:g}" if s else ""
            cell = ""
            if d and "ratio" in d:
                kind, _ = time_class(d, class_band(runs.get("prefill", {}), band))
                cell = (f"{d['ratio']:g} [{d['interval'][0]:g}, {d['interval'][1]:g}] "
                        f"{ {'differs': 'differs', 'within': 'within'}.get(kind, 'n.m.') }")
            elif d:  # no ratio: why, never a judgement
                cell = f"not judged: {d['error']}"
            pos = " / ".join(f"{a:.0%}" for a in s.get("acceptance_per_position", ())) if s else ""
            out.append(f"| {c} | {run} | {row['prompts']} | {tok} | {eos} | {acc} | {pos} | {tps} | {cell} |")
    return out
