"""The stored kvfill-check reports and docs/fidelity.md say only what their
figures show (issue 67): every timed pass's tokens per step counts every
decode step (or nothing was accepted, so one token a step is exact), a
report the fix moves is judged again by today's code with what could not be
recomputed named, its per-class lines agree with the table made from it,
and the doc's table, run time, thin samples, capped lengths and "n.m."
cells are the reports'."""
import glob
import json
import os

import pytest

vllm = pytest.importorskip("vllm")  # the reports' command lines are parsed by kvfill-check's (vLLM's) parser

from kvfill.bench import fidelity  # noqa: E402
from kvfill.check import compare, verdict  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORTS = sorted(glob.glob(os.path.join(ROOT, "bench", "results", "check-*.json"))) + sorted(
    glob.glob(os.path.join(fidelity.RESULTS, "check-*.json")))


FIGURES = ("ms_per_token", "ratio", "interval", "passes", "steps")


@pytest.fixture(autouse=True)
def _vllm_platform(vllm_cpu_platform):
    """conftest's vllm_cpu_platform for every test here: on the 0.34 lane the reports' command lines are parsed
    by vLLM's flag parser, which needs a platform whatever test ran before in this process."""


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _moved(data: dict) -> bool:
    """Whether the fixes of issue 67 move this report's figures or lines: a drafter, or prompt classes."""
    return bool(data.get("speculative_config") or data.get("prompt_classes"))


@pytest.mark.parametrize("path", REPORTS, ids=os.path.basename)
def test_a_stored_pass_gives_tokens_per_step_over_every_step_it_ran(path):
    data = _load(path)
    for run, step in data["steps"].items():
        timing = step.get("timing") or {}
        for p in timing.get("passes", []):
            if "tokens" not in p:  # nothing accepted: every request-step gained one token, as stored
                assert p["tokens_per_step"] == 1.0, (run, p["kind"], p["tokens_per_step"])
                continue
            assert p["tokens_per_step"] == round(compare.tokens_per_step(
                p["tokens"], p["accepted"], p["request_steps"], p["drafts"]), 4), (run, p["kind"])
        if timing.get("passes") and run in data["comparison"]:  # its figures (older reports hold fewer fields)
            stored, now = data["comparison"][run]["decode_time"], compare.decode_time(timing)
            assert [stored[k] for k in FIGURES] == [now[k] for k in FIGURES], run


@pytest.mark.parametrize("path", [p for p in REPORTS if _moved(_load(p))], ids=os.path.basename)
def test_a_report_the_fix_moves_is_todays_judgement_and_names_what_it_could_not_recompute(path):
    data = _load(path)
    mark = data.get("rejudged")
    if not mark:  # stored by code with the fix (the depth study's): its lines are today's judgement as they stand
        assert data["verdicts"] == verdict.verdicts(data, data["comparison"]), \
            "judged by the code that stored it: bench/fidelity.py --rejudge"
        return
    first, *lines = data["verdicts"]
    assert first.startswith("re-judged from this report's stored figures") and mark["stored_by"] in first
    assert lines == verdict.verdicts(data, data["comparison"])
    for c, runs in (data["comparison"].get("by_class") or {}).items():
        for run, row in runs.items():
            d = row.get("decode_time") or {}
            if "stored" in d:  # not recomputed: named, with the code that judged it
                assert f"class {c}'s {run} decode time" in first and d["judged_by"] == mark["stored_by"], run


@pytest.mark.parametrize("name", [n for n, _, _ in fidelity.FAMILIES])
def test_a_fidelity_reports_class_lines_agree_with_the_table_made_from_it(name):
    path = os.path.join(fidelity.RESULTS, f"check-{name}-cpu.json")
    data = _load(path)
    if not data["comparison"].get("by_class"):
        pytest.skip("one depth: no class lines")
    rows = fidelity.rows_of(f"check-{name}-cpu", name, data)
    for row in rows:
        depth, fill, cell = row[1], row[2], row[4]
        if depth not in data["comparison"]["by_class"]:
            continue
        line = next(ln for ln in data["verdicts"] if ln.startswith(f"{fill}, class {depth} ("))
        if cell.startswith("not recomputed"):
            assert "decode time not judged" in line, (line, cell)
        else:
            shows = cell.split("] ")[1].split(" ")[0]
            assert f"({shows})" in line, (line, cell)
        assert f"greedy tokens {row[3].split()[0]} as real prefill's" in line, (line, row[3])
        if row[5] and not row[5].startswith("+0 pp"):  # the table shows acceptance moved: so does the line
            fill_counts = row[5].split("(")[1].split()[0]  # the fill's accepted/draft tokens, or "no" drafts
            assert ("no drafts vs acceptance" if fill_counts == "no" else f"({fill_counts} vs ") in line, (line, row[5])
        assert ("(each =)" in row[7]) == ("(each equal)" in line), (line, row[7])


def test_the_docs_table_is_what_fidelity_py_makes_of_the_stored_reports():
    with open(fidelity.DOC) as f:
        doc = f.read()
    assert fidelity.markdown(*fidelity.table()[:2]) in doc


def test_the_docs_run_time_and_run_s_help_are_the_stored_reports_runtimes(capsys):
    minutes = f"about {fidelity.run_seconds() / 60:.0f} minutes"
    with open(fidelity.DOC) as f:
        doc = " ".join(f.read().split())
    assert minutes in doc
    with pytest.raises(SystemExit):
        fidelity.main(["--help"])
    assert minutes in " ".join(capsys.readouterr().out.split())


def test_the_table_marks_thin_samples_and_names_the_cap_where_lengths_reach_it():
    data = _load(os.path.join(fidelity.RESULTS, "check-real-fidelity-cpu.json"))
    cap = fidelity._args(data).max_tokens
    per = data["comparison"]["by_class"]
    named = 0
    for row in fidelity.rows_of("check-real-fidelity-cpu", "real", data):
        prompts = int(row[9].split()[0])
        assert ("thin" in row[9]) == (prompts < verdict.THIN), row[9]
        runs = per.get(row[1]) or {r: data["comparison"][r] for r in ("prefill", row[2])}
        real = runs["prefill"]["eos"]["lengths"]
        if cap in real:
            assert f"at the {cap} cap:" in row[7] and f"{real.count(cap)}/{len(real)} real" in row[7], row[7]
            named += 1
    assert named  # real prefill's 600-token prompts reach the cap: the cell says so


def test_the_docs_prose_calls_no_n_m_replay_cell_within():
    rows, _ = fidelity.table()
    replay = [r[4] for r in rows if r[2] == "replay" and r[4]]
    with open(fidelity.DOC) as f:
        doc = " ".join(f.read().split())
    if any(" n.m. " in cell for cell in replay):
        assert "decode time within what the host resolves" not in doc
