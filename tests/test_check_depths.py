"""kvfill-check along depth (check/depths.py, ``--depths``): each prompt cut
to its first D tokens in its own text, each depth a class; acceptance per
draft position; the report's depth table and curves - on the tiny Llama's
word tokenizer and made-up runs (end to end: test_check.py's depth check)."""
import json

import pytest

vllm = pytest.importorskip("vllm")  # kvfill.check's CLI reads vLLM's engine flags
pytestmark = pytest.mark.cpu_only

from kvfill.check import classes, compare, depths, report, verdict  # noqa: E402
from kvfill.check.cli import CheckError, check_config  # noqa: E402
from kvfill.check.inputs import prepare  # noqa: E402


@pytest.fixture(autouse=True)
def _vllm_platform(vllm_cpu_platform):
    """conftest's vllm_cpu_platform for every test here."""


def test_depths_parse_as_token_counts_smallest_first_and_a_bad_one_is_named():
    assert depths.parse("8k,300, 1K") == [("300", 300), ("1k", 1024), ("8k", 8192)]
    for text, named in (("1k,x", "'x' is not a depth"), ("0", "'0' is not a depth"), ("1.5k", "'1.5k'"),
                        ("1k,1024", "'1024' is the same depth as '1k' (1024 tokens)"), ("", "'' is not a depth")):
        with pytest.raises(ValueError, match="--depths") as e:
            depths.parse(text)
        assert named in str(e.value), e.value


def _prompts(tmp_path, lines, classes=None):
    path = tmp_path / ("p.jsonl" if classes else "p.txt")
    if classes:
        path.write_text("".join(json.dumps({"prompt": p, "class": c}) + "\n" for p, c in zip(lines, classes)))
    else:
        path.write_text("".join(p + "\n" for p in lines))
    return str(path)


def test_each_prompt_is_cut_to_each_depth_in_its_own_text_depth_by_depth(check_model, tmp_path):
    """Two prompts of 40 and 50 words (the tokenizer adds no BOS: a word a
    token), --depths 10,30: four prompts, each a prefix of its own text whose
    tokens are the first D of the whole prompt's; classes CLASS.D; the runs'
    max_model_len follows the deepest cut, not the whole prompts."""
    model, _ = check_model
    whole = [" ".join(f"w{5 + i % 7}" for i in range(40)), " ".join(f"w{20 + i % 5}" for i in range(50))]
    prompts = _prompts(tmp_path, whole, ["code", "prose"])
    cfg = check_config(["--model", model, "--prompts", prompts, "--depths", "30,10", "--output-len", "4",
                        "--max-tokens", "0"])
    assert cfg.depths == [("10", 10), ("30", 30)]
    inputs = prepare(cfg)
    assert inputs.classes == ["code.10", "prose.10", "code.30", "prose.30"]
    assert inputs.depths == ["10", "10", "30", "30"]
    assert [len(t) for t in inputs.ids] == [10, 10, 30, 30]
    full = [inputs.tok(p).input_ids for p in whole]
    for text, ids, i in zip(inputs.texts, inputs.ids, (0, 1, 0, 1)):
        assert whole[i].startswith(text) and ids == full[i][:len(ids)] == inputs.tok(text).input_ids
    assert inputs.max_len == 30 + 4 + 16  # the longest cut + output + the check's slack


def test_a_prompt_shorter_than_the_largest_depth_is_refused_naming_it(check_model, tmp_path):
    model, _ = check_model
    prompts = _prompts(tmp_path, [" ".join(["w5"] * 40), " ".join(["w6"] * 12)])
    with pytest.raises(CheckError, match=r"--depths 20: prompt 2 of .*p\.txt' has 12 tokens \(1 of 2 prompts are "
                                         r"shorter than 20\); expected every prompt at least as long"):
        prepare(check_config(["--model", model, "--prompts", prompts, "--depths", "10,20"]))

def test_a_bad_depths_value_exits_2_naming_it(check_model, capsys):
    model, prompts = check_model
    with pytest.raises(SystemExit) as e:
        check_config(["--model", model, "--prompts", prompts, "--depths", "4,k"])
    assert e.value.code == 2 and "--depths '4,k': 'k' is not a depth; expected token counts" in capsys.readouterr().err


class _MergingTokenizer:
    """A tokenizer whose tokens are characters but for "ab", one token:
    text cut between a and b re-tokenizes to other tokens than the whole's."""

    def __call__(self, text, return_offsets_mapping=False):
        ids, offsets, i = [], [], 0
        while i < len(text):
            n = 2 if text[i:i + 2] == "ab" else 1
            ids.append(1000 if n == 2 else ord(text[i]))
            offsets.append((i, i + n))
            i += n
        out = {"input_ids": ids}
        if return_offsets_mapping:
            out["offset_mapping"] = offsets
        return type("Enc", (dict,), {"__getattr__": dict.__getitem__})(out)


def test_a_cut_moves_back_to_a_boundary_the_text_re_tokenizes_at():
    tok = _MergingTokenizer()
    ids = tok("xyzab").input_ids  # x y z ab: 4 tokens
    assert depths.cut_one(tok, "xyzab", ids, 4) == ("xyzab", ids)
    assert depths.cut_one(tok, "xyzab", ids, 3) == ("xyz", ids[:3])


def test_acceptance_per_position_counts_each_drafts_accepted_prefix():
    tokens = [5, 6, 7, 8, 9, 10, 11]
    drafts = [[6, 7, 0], [9, 1, 1], [11, 2, 2], [3, 3, 3]]  # 2, then 1, then 1 accepted; the last never verified
    assert classes.accepted_per_position(tokens, drafts) == [3, 1, 0]
    assert sum(classes.accepted_per_position(tokens, drafts)) == classes.accepted(tokens, drafts)[0]
    assert classes.accepted_per_position([5], [[6, 7]]) == []
    counted = classes.counted([{"tokens": tokens, "drafts": drafts}, {"tokens": [1, 2, 3], "drafts": [[2, 3]]}])
    assert counted["num_accepted_tokens_per_pos"] == [4, 2, 0]  # the second request's one draft accepted whole
    assert compare.spec(counted, 10)["acceptance_per_position"] == [round(4 / 4, 4), 0.5, 0.0]


# Two prompts (kinds a and b) at two depths: real prefill accepts every draft whole at 10 tokens, one token of
# three at 30; a zeros fill accepts one in three at both and its outputs are longer at 30.
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9]
WHOLE, ONE = [[2, 3, 4], [6, 7, 8]], [[2, 0, 0], [4, 0, 0], [6, 0, 0], [8, 0, 0]]


def _run(drafts, lengths):
    rows = [{"tokens": TOKENS, "logprobs": [-1.0] * len(TOKENS), "drafts": d} for d in drafts]
    return {"greedy": rows, "eos": [{"length": x, "eos": True} for x in lengths],
            "counters": classes.counted(rows), "eos_counters": {}, "timing": None, "step_s": 1.0}


def test_by_depth_gathers_every_class_of_a_depth_and_the_report_draws_and_tables_it(tmp_path):
    steps = {"prefill": _run([WHOLE, WHOLE, ONE, ONE], [10, 12, 20, 22]),
             "replay": _run([WHOLE, WHOLE, ONE, ONE], [10, 12, 20, 22]),
             "zeros": _run([ONE, ONE, ONE, ONE], [10, 12, 40, 44])}
    res = {"steps": steps, "prompt_tokens": [10, 10, 30, 30], "prompt_classes": ["a.10", "b.10", "a.30", "b.30"],
           "prompt_depths": ["10", "10", "30", "30"], "depths": {"10": 10, "30": 30}, "bank_recorded": True,
           "runtime_s": 1.0, "moe_note": None}
    cmp = compare.compare_all(res)
    per = cmp["by_depth"]
    assert list(per) == ["10", "30"] and list(cmp["by_class"]) == ["a.10", "b.10", "a.30", "b.30"]
    assert per["10"]["prefill"]["spec"]["acceptance"] == 1.0 and per["30"]["prefill"]["spec"]["acceptance"] == \
        round(8 / 24, 4)
    assert per["10"]["prefill"]["spec"]["acceptance_per_position"] == [1.0, 1.0, 1.0]
    assert per["30"]["zeros"]["spec"]["acceptance_per_position"] == [1.0, 0.0, 0.0]
    assert per["30"]["replay"]["spec"] == per["30"]["prefill"]["spec"]
    assert per["30"]["zeros"]["eos"]["mean"] == 42 and not per["30"]["zeros"]["eos_lengths_identical"]
    curves = dict(report.depth_curves(res, cmp))
    assert curves["acceptance (%) vs depth"]["prefill"] == ([10, 30], [100.0, 100 * round(8 / 24, 4)])
    assert curves["EOS-honoured mean output length vs depth"]["zeros"] == ([10, 30], [11, 42])
    lines = verdict.verdicts(res, cmp)
    assert any("zeros: differs from real prefill in classes a.10 (acceptance)" in ln for ln in lines), lines
    cfg = check_config(["--model", str(tmp_path), "--prompts", __file__, "--out", str(tmp_path / "r")])
    md = report.markdown(cfg, res, cmp, lines)
    assert "## By depth" in md and "| 30 | zeros | 2 | 18/18 | 42 | 33% (8/24) | 100% / 0% / 0% | 2 |" in md
    assert report.plot(str(tmp_path / "report.png"), res, cmp, "tiny")
    assert (tmp_path / "report.png").stat().st_size > 0


@pytest.mark.e2e
@pytest.mark.usefixtures("leaves_nothing")
def test_kvfill_check_along_depth_on_a_sliding_window_model_with_ngram_drafts(tmp_path):
    """``kvfill-check --depths 200,400`` as a user runs it, on the user's
    own two prompts (classes code and prose, 500 words each: 50 words ten
    times over, so the ngram drafter finds matches) and the tiny Gemma3
    (sliding window 256 beside full attention: the deeper class reaches
    past the window).  Each depth is a class gathering both kinds; replay
    equals real prefill at each depth in greedy tokens, drafts and
    acceptance per position, and EOS-honoured lengths; the recording read the
    cut prompts (its bank holds 200 and 400 positions); the report tables
    and draws the depths."""
    import subprocess
    import sys

    from safetensors import safe_open

    from kvfill.bench.models import make_model, make_tokenizer, word_prompts
    from kvfill.kernels import BankIndex

    model = make_tokenizer(make_model(str(tmp_path / "model"), hybrid=True, init_std=0.15))
    whole = [" ".join(p.split() * 10) for p in word_prompts([50, 50], seed=11)]
    prompts = _prompts(tmp_path, whole, ["code", "prose"])
    out = tmp_path / "out"
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                       "prompt_lookup_min": 2})
    r = subprocess.run([sys.executable, "-m", "kvfill.check", "--model", model, "--prompts", prompts, "--out", str(out),
                        "--depths", "400,200", "--fills", "replay", "--output-len", "10", "--max-tokens",
                        "16", "--time-passes", "0", "--speculative-config", spec], capture_output=True, text=True,
                       timeout=900)
    data = json.loads((out / "report.json").read_text())
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert data["prompt_tokens"] == [200, 200, 400, 400] and data["depths"] == {"200": 200, "400": 400}
    assert data["prompt_classes"] == ["code.200", "prose.200", "code.400", "prose.400"]
    cut = [json.loads(line) for line in (out / "logs" / "depth-prompts.jsonl").read_text().splitlines()]
    assert [c["class"] for c in cut] == data["prompt_classes"]
    assert all(whole[i % 2].startswith(c["prompt"]) for i, c in enumerate(cut))
    assert list(BankIndex.read(data["bank"]).lengths) == [200, 200, 400, 400]  # the recording read the cut prompts
    with safe_open(data["bank"], "pt") as f:
        assert f.keys()
    cmp = data["comparison"]
    per = cmp["by_depth"]
    assert list(per) == ["200", "400"]
    for d, runs in per.items():
        ref, replay = runs["prefill"], runs["replay"]
        assert replay["tokens"]["identical"] and replay["eos_lengths_identical"], (d, replay)
        assert ref["spec"] and ref["spec"]["drafts"] > 0, (d, ref)  # the drafter proposed at this depth
        assert replay["spec"] == ref["spec"] and len(ref["spec"]["acceptance_per_position"]) == 3, (d, ref)
    assert cmp["replay"]["drafts_equal"]["equal"] == cmp["replay"]["drafts_equal"]["total"] > 0
    own = cmp["prefill"]["spec"]["acceptance_per_position"]  # vLLM's own per-position counter, read from its metrics
    assert len(own) == 3 and own[0] >= own[1] >= own[2], own
    first = data["steps"]["prefill"]["first_token_s"]  # each prompt's time to its first token, from vLLM's stats
    assert len(first) == 4 and all(t is not None and t > 0 for t in first), first
    md = (out / "report.md").read_text()
    assert "## By depth" in md and "| 400 | replay | 2 |" in md
    assert (out / "report.png").stat().st_size > 0


def test_the_depth_studys_table_and_plot_read_a_reports_depths(tmp_path):
    """bench/fidelity_depth.py's rows and curves from a report as
    kvfill-check stores it (made-up runs): a row per depth and run beside
    real prefill's figures, and the plot drawn."""
    from kvfill.bench import fidelity_depth

    steps = {"prefill": _run([WHOLE, WHOLE, ONE, ONE], [10, 12, 20, 22]),
             "zeros": _run([ONE, ONE, ONE, ONE], [10, 12, 40, 44])}
    res = {"steps": steps, "prompt_tokens": [10, 10, 30, 30], "prompt_classes": ["a.10", "b.10", "a.30", "b.30"],
           "prompt_depths": ["10", "10", "30", "30"], "depths": {"10": 10, "30": 30}}
    data = {**res, "comparison": compare.compare_all(res)}
    rows = fidelity_depth.rows_of("check-depth-x-cpu", "x", data)
    assert [r[1:3] for r in rows] == [["10", "prefill"], ["10", "zeros"], ["30", "prefill"], ["30", "zeros"]]
    assert rows[1][3:8] == ["18/18", "33% vs 100%", "100% / 0% / 0% vs 100% / 100% / 100%", "2.0 vs 4.0",
                            "11.0 vs 11.0 (each =)"]
    assert rows[3][8] == "2 prompts, 8 drafts" and len(rows[0]) == len(fidelity_depth.HEADER)
    variant = {**res, "prompt_classes": ["a.30"], "prompt_depths": None, "prompt_tokens": [30],
               "steps": {r: {k: v[2:3] if isinstance(v, list) else v for k, v in got.items()}
                         for r, got in steps.items()}}  # one prompt already cut, no --depths: by its class
    variant["comparison"] = compare.compare_all(variant)
    assert [(r[1], r[2], r[3], r[8]) for r in fidelity_depth.rows_of("v", "x", variant)] == [
        ("a.30", "prefill", "reference", "1 prompts, 4 drafts"), ("a.30", "zeros", "9/9", "1 prompts, 4 drafts")]
    assert fidelity_depth.longest_first_token(data) is None  # a report from before first_token_s
    steps["prefill"]["first_token_s"] = [1.5, None, 9.25, 8.0]
    assert fidelity_depth.longest_first_token(data) == (9.25, 30)
    assert fidelity_depth.plot([("x", "", data)], str(tmp_path / "depth.png"))
    assert (tmp_path / "depth.png").stat().st_size > 0
