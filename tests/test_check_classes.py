"""kvfill-check by prompt class (check/classes.py): each prompt's class from
a JSONL prompts file, acceptance per request from its drafts, and a fill's
acceptance, EOS lengths and decode time per class - on made-up runs in the
shape measure.run writes them (the end-to-end one: test_check.py's
self-drafting check)."""
import json

import pytest

vllm = pytest.importorskip("vllm")  # kvfill.check's CLI and kvfill-record's inputs read vLLM's

from kvfill.check import classes, compare, report, verdict  # noqa: E402
from kvfill.check.cli import check_config  # noqa: E402
from kvfill.record.inputs import RecordError, read_prompt_classes  # noqa: E402


def test_a_drafts_accepted_tokens_are_the_prefix_the_requests_next_tokens_equal():
    tokens = [5, 6, 7, 8, 9, 10, 11]
    # after token 5: draft [6, 7, 0] -> 2 accepted (6, 7), then 8 from the target; after 8: [9, 1, 1] -> 1;
    # after 10: [11, 2, 2] -> 1 (11, the last token); a draft after the last token was never verified
    assert classes.accepted(tokens, [[6, 7, 0], [9, 1, 1], [11, 2, 2], [3, 3, 3]]) == (4, 9, 3)
    # a step without a draft gains one token: after 5, [0, 0] -> 6; no draft -> 7; after 7, [8] -> 1 accepted
    assert classes.accepted(tokens, [[0, 0], [], [8]]) == (1, 3, 2)
    assert classes.accepted(tokens, [[0, 0], [], [7]]) == (0, 3, 2)  # the same steps, a draft one token late
    assert classes.accepted([5], [[6, 7]]) == (0, 0, 0)  # one token: its draft never verified


def test_prompt_classes_come_from_every_jsonl_line_or_none_and_a_bad_one_is_named(tmp_path):
    def write(name, items):
        path = tmp_path / name
        path.write_text("".join(json.dumps(i) + "\n" for i in items))
        return str(path)

    assert read_prompt_classes(write("a.jsonl", [{"prompt": "x", "class": "code"}, {"prompt": "y", "class": "prose"}])
                               ) == ["code", "prose"]
    assert read_prompt_classes(write("b.jsonl", [{"prompt": "x"}, {"prompt": "y"}])) is None
    text = tmp_path / "c.txt"
    text.write_text('{"prompt": "x", "class": "code"}\n')
    assert read_prompt_classes(str(text)) is None  # a text file's lines are prompts, whatever they hold
    for items, named in (([{"prompt": "x", "class": "code"}, {"prompt": "y"}], "line 2: \"class\" is None"),
                         ([{"prompt": "x", "class": "a b"}], "line 1: \"class\" is 'a b'"),
                         ([{"prompt": "x", "class": 3}], "line 1: \"class\" is 3")):
        with pytest.raises(RecordError, match=named):
            read_prompt_classes(write("bad.jsonl", items))


def _timing(kinds, ms, real_ms=2.0, passes=3, steps=8):
    out = [{"kind": kinds[i % 2], "ms": [(ms if i % 2 == 0 else real_ms) * (1 + 0.02 * ((j * 7 + i) % 5 - 2))
                                         for j in range(steps)],
            "batch": [2] * steps, "tokens_per_step": 1.0, "wall_s": 1.0, "cpu_s": 1.9, "thread_cpu_s": 0.9,
            "load": [0.5, 0.7]} for i in range(2 * passes)]
    return {"passes": out, "torch_threads": 2, "cores": 2}


# Prompts 0 and 2 get the first tokens, 1 and 3 the second; per tokens, drafts the target accepts whole
# (WHOLE: 6/6) or one token of in three (ONE: 4/12).
TOKENS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]] * 2
WHOLE = [[[2, 3, 4], [6, 7, 8]], [[12, 13, 14], [16, 17, 18]]]
ONE = [[[2, 0, 0], [4, 0, 0], [6, 0, 0], [8, 0, 0]], [[12, 0, 0], [14, 0, 0], [16, 0, 0], [18, 0, 0]]]


def _run(run, drafts, lengths, slow=None):
    kinds = ("real", "real'") if run == "prefill" else ("fill", "real")
    rows = [{"tokens": t, "logprobs": [-1.0] * len(t), "drafts": d} for t, d in zip(TOKENS, drafts)]
    acc = sum(classes.accepted(r["tokens"], r["drafts"])[0] for r in rows)
    drafted = sum(classes.accepted(r["tokens"], r["drafts"])[1] for r in rows)
    n = sum(classes.accepted(r["tokens"], r["drafts"])[2] for r in rows)
    return {"run": run, "greedy": rows, "eos": [{"length": x, "eos": True} for x in lengths],
            "counters": {"num_drafts": n, "num_draft_tokens": drafted, "num_accepted_tokens": acc},
            "eos_counters": {}, "timing": _timing(kinds, 2.0), "step_s": 5.0,
            "timing_by_class": {c: _timing(kinds, 4.0 if c == slow else 2.0) for c in ("code", "prose")}}


def test_acceptance_eos_lengths_and_decode_time_are_reported_per_class_and_the_differing_class_named(tmp_path):
    """Real prefill accepts the code prompts' drafts whole and a third of the
    prose ones'; replay equals it in each class; a fill that breaks the code
    prompts' drafts (accepting a third there too), lengthens the prose
    prompts' outputs and decodes prose 2x slower is named as differing in
    both classes, each with what moved, in its lines, summary and the
    report's table."""
    code_prose = [WHOLE[0], ONE[1], WHOLE[0], ONE[1]]  # prompts 0 and 2 are code, 1 and 3 prose
    steps = {"prefill": _run("prefill", code_prose, [10, 20, 12, 18]),
             "replay": _run("replay", code_prose, [10, 20, 12, 18]),
             "normal": _run("normal", [ONE[0], ONE[1], ONE[0], ONE[1]], [10, 30, 12, 28], slow="prose")}
    res = {"steps": steps, "prompt_tokens": [3, 4, 3, 4], "prompt_classes": ["code", "prose", "code", "prose"],
           "bank_recorded": True, "runtime_s": 1.0, "moe_note": None}
    cmp = compare.compare_all(res)
    per = cmp["by_class"]
    assert list(per) == ["code", "prose"]
    assert per["code"]["prefill"]["spec"]["acceptance"] == 1.0 and per["prose"]["prefill"]["spec"]["acceptance"] == \
        round(8 / 24, 4)  # the two classes' acceptance differs under real prefill
    for c in per:  # summed over the classes: the run's own counters
        assert per[c]["replay"]["spec"] == per[c]["prefill"]["spec"] and per[c]["replay"]["tokens"]["identical"]
    assert sum(per[c]["prefill"]["spec"]["accepted"] for c in per) == cmp["prefill"]["spec"]["accepted"]
    assert per["code"]["normal"]["spec"]["acceptance"] == round(8 / 24, 4)
    assert per["code"]["normal"]["eos_lengths_identical"] and not per["prose"]["normal"]["eos_lengths_identical"]
    lines = verdict.verdicts(res, cmp)
    text = "\n".join(lines)
    assert "replay: no class differs from real prefill in what was measured per class" in text
    assert ("normal, class code (2 prompts): greedy tokens 18/18 as real prefill's; acceptance 33% vs 100% (8/24 vs "
            "12/12 draft tokens)") in text
    assert "normal: differs from real prefill in classes code (acceptance); prose (EOS lengths, decode time)" in text
    summary = next(ln for ln in lines if ln.startswith("=> normal:"))
    assert "class code (acceptance)" in summary and "class prose (EOS lengths, decode time)" in summary
    assert not any(ln.startswith("=> replay: not valid") for ln in lines)
    cfg = check_config(["--model", str(tmp_path), "--prompts", __file__, "--out", str(tmp_path / "r")])
    md = report.markdown(cfg, res, cmp, lines)
    assert "## By prompt class" in md
    assert "| code | prefill | 2 | reference | 11 | 100% (12/12) | 100% / 100% / 100% | 4 |" in md
    assert "| prose | normal | 2 | 18/18 | 29 | 33% (8/24) | 100% / 0% / 0% | 2 | 2 [1.96, 2.082] differs |" in md


def test_a_fill_whose_drafter_proposes_nothing_on_a_class_differs_there():
    steps = {"prefill": _run("prefill", [WHOLE[0], ONE[1], WHOLE[0], ONE[1]], [10, 20, 12, 18]),
             "zeros": _run("zeros", [[], ONE[1], [], ONE[1]], [10, 20, 12, 18])}
    res = {"steps": steps, "prompt_tokens": [3, 4, 3, 4], "prompt_classes": ["code", "prose", "code", "prose"],
           "bank_recorded": True, "runtime_s": 1.0, "moe_note": None}
    cmp = compare.compare_all(res)
    assert cmp["by_class"]["code"]["zeros"]["spec"] is None
    text = "\n".join(verdict.verdicts(res, cmp))
    assert ("zeros, class code (2 prompts): greedy tokens 18/18 as real prefill's; no drafts vs acceptance 100% "
            "(12/12)") in text
    assert "zeros: differs from real prefill in class code (acceptance)" in text


def test_a_run_without_classes_has_no_figures_per_class():
    steps = {"prefill": _run("prefill", WHOLE * 2, [10, 20, 12, 18])}
    res = {"steps": steps, "prompt_tokens": [3, 4, 3, 4], "bank_recorded": True, "runtime_s": 1.0,
           "moe_note": None}
    assert "by_class" not in compare.compare_all(res) and classes.groups(None) == {}


def test_drafters_that_propose_from_the_runs_history_are_named_with_what_replay_cannot_make_equal():
    assert classes.history_note({"method": "draft_model"}) is None and classes.history_note(None) is None
    suffix = classes.history_note({"method": "suffix"})
    assert "suffix decoding proposes from a tree of the outputs" in suffix and "not that history" in suffix
    assert "FLy's lossy" in classes.history_note({"method": "eagle", "rejection_sample_method": "fly"})
    assert "configured rates" in classes.history_note({"method": "mtp", "rejection_sample_method": "synthetic"})
    assert classes.history_note({"method": "mtp", "rejection_sample_method": "block"}) is None


def _undrafted(run, tokens, lengths):
    """A run without a drafter: its greedy tokens and EOS lengths, timed alike in every class."""
    kinds = ("real", "real'") if run == "prefill" else ("fill", "real")
    return {"run": run, "greedy": [{"tokens": t, "logprobs": [-1.0] * len(t)} for t in tokens],
            "eos": [{"length": x, "eos": True} for x in lengths], "counters": {}, "eos_counters": {},
            "timing": _timing(kinds, 2.0), "step_s": 5.0,
            "timing_by_class": {c: _timing(kinds, 2.0) for c in ("code", "prose")}}


def _classed(steps):
    return {"steps": steps, "prompt_tokens": [3, 4, 3, 4], "prompt_classes": ["code", "prose", "code", "prose"],
            "bank_recorded": True, "runtime_s": 1.0, "moe_note": None}


def test_a_class_whose_eos_lengths_are_within_the_runs_floor_does_not_differ():
    """Real prefill's lengths 10, 20, 12, 18 give the run a floor of 8 (its
    even prompts' mean 11, its odd ones' 19); a fill one prompt of which ends
    2 tokens later (code: 12 against 11) is within that floor in all and in
    its class alike - one length unlike real prefill's is not a difference."""
    steps = {"prefill": _undrafted("prefill", TOKENS, [10, 20, 12, 18]),
             "zeros": _undrafted("zeros", TOKENS, [10, 20, 14, 18])}
    res = _classed(steps)
    cmp = compare.compare_all(res)
    lines = verdict.verdicts(res, cmp)
    text = "\n".join(lines)
    assert "zeros: EOS-honoured output length 15.5 vs 15 real tokens" in text and "within real prefill's floor" in text
    code = next(ln for ln in lines if ln.startswith("zeros, class code"))
    assert "EOS mean length 12 vs 11, within real prefill's floor (8)" in code, code
    assert next(ln for ln in lines if ln.startswith("=> zeros:")).startswith("=> zeros: valid for this benchmark")
    assert not any(ln.startswith("zeros: differs from real prefill in class") for ln in lines), lines


def test_a_classs_greedy_tokens_are_judged_and_no_class_is_said_to_differ_in_nothing_when_they_do():
    """A fill that writes other text in every class (its tokens 0/18 in
    each), every length and time as real prefill's: each class line gives
    its tokens, and the closing line names the classes whose tokens differ
    instead of saying no class differs in what was measured."""
    other = [[t + 50 for t in row] for row in TOKENS]
    steps = {"prefill": _undrafted("prefill", TOKENS, [10, 20, 12, 18]),
             "replay": _undrafted("replay", TOKENS, [10, 20, 12, 18]),
             "zeros": _undrafted("zeros", other, [10, 20, 12, 18])}
    res = _classed(steps)
    lines = verdict.verdicts(res, compare.compare_all(res))
    text = "\n".join(lines)
    assert "zeros, class code (2 prompts): greedy tokens 0/18 as real prefill's" in text, text
    assert "replay, class prose (2 prompts): greedy tokens 18/18 as real prefill's" in text, text
    assert "zeros: no class differs" not in text
    assert "zeros: greedy tokens differ from real prefill's in classes code (0/18), prose (0/18)" in text, text
    assert "replay: no class differs from real prefill in what was measured per class" in text
