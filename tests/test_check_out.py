"""kvfill-check's --out is one check's at a time, and what it holds is this
run's (issue 67): a second check into a folder another one writes is
refused naming the holder; a rerun removes the earlier report before its
first step; a check stopped by a signal after real prefill writes a report
of what it measured, marked partial.  The steps are stood in for (no
engine): what is tested is the check around them."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.cpu_only


@pytest.fixture(autouse=True)
def _vllm_platform(vllm_cpu_platform):
    """conftest's vllm_cpu_platform for every test here."""


def _measured(run: str) -> dict:
    """A run's result as measure.run gives it, for the one prompt of check_model's prompts file."""
    return {"run": run, "greedy": [{"tokens": [5, 6, 7, 8], "logprobs": [-0.5] * 4}],
            "eos": [{"length": 4, "eos": False}], "counters": {}, "eos_counters": {}, "timing": {}, "step_s": 1.0}


def test_an_out_another_check_holds_is_refused_naming_it_and_its_pid(check_model, tmp_path, capsys, monkeypatch):
    """Two checks into one --out wrote one report over the other's.  A stand-in holds the folder as a check
    does; a second check exits 2 naming the folder and the holder's pid, writing nothing; once the holder is
    killed (SIGKILL: no way out of its own runs) the folder is free."""
    import kvfill.check.runner as runner
    from kvfill.check.__main__ import main

    model, prompts = check_model
    out = tmp_path / "report"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from kvfill.check.report import holding\n"
                               f"with holding({str(out)!r}):\n    print('held', flush=True)\n    time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        ran = []
        monkeypatch.setattr(runner, "run_all", lambda *a, **k: ran.append(1) or {})
        before = sorted(os.listdir(out))
        assert main(["--model", model, "--prompts", prompts, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvfill-check: error: --out {str(out)!r} is in use by another kvfill-check (pid "
                              f"{holder.pid}) writing its report there; expected an --out no running check holds"), err
        assert not ran and sorted(os.listdir(out)) == before
    finally:
        holder.kill()
        holder.wait(30)
    monkeypatch.setattr(runner, "run_all", lambda *a, **k: (_ for _ in ()).throw(SystemExit("ran")))
    with pytest.raises(SystemExit, match="ran"):  # not refused: the lock went with the holder
        main(["--model", model, "--prompts", prompts, "--out", str(out)])


def test_a_rerun_removes_the_earlier_report_before_its_first_step(check_model, tmp_path, monkeypatch, capsys):
    """A rerun stopped in its recording (before real prefill: nothing to report) left the earlier check's
    report.json, .md and .png in place, read as this run's."""
    import kvfill.check.runner as runner
    from kvfill.check.__main__ import main

    model, prompts = check_model
    out = tmp_path / "report"
    (out / "logs").mkdir(parents=True)
    for name in ("report.json", "report.md", "report.png"):
        (out / name).write_text("an earlier check's")
    seen = {}

    def stopped_in_the_recording(name, job, cfg, i, n, log, env=None):
        seen[name] = sorted(os.listdir(out))
        os.kill(os.getpid(), signal.SIGTERM)  # the check's handler raises Stopped here
        time.sleep(10)
        raise AssertionError("SIGTERM did not stop the check")

    monkeypatch.setattr(runner, "step", stopped_in_the_recording)
    assert main(["--model", model, "--prompts", prompts, "--out", str(out), "--fills", "zeros"]) == 143
    assert seen == {"record": [".kvfill-check.lock", "logs"]}, seen
    assert sorted(os.listdir(out)) == [".kvfill-check.lock", "logs"]
    assert "no report written (real prefill was not measured: nothing to compare)" in capsys.readouterr().err


def test_a_check_stopped_after_real_prefill_writes_a_partial_report_of_what_it_measured(
        check_model, tmp_path, monkeypatch, capsys):
    """SIGTERM while the third run (normal) runs: exit 143, and a report of prefill and zeros, marked partial in
    report.json and report.md, normal's lines saying it was not run and why."""
    import kvfill.check.runner as runner
    from kvfill.check.__main__ import main

    model, prompts = check_model

    def steps(name, job, cfg, i, n, log, env=None):
        if name == "record":
            return {"run": "record", "error": "exit 1: a stand-in recording (log record.log)", "step_s": 1.0}
        if name == "normal":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
            raise AssertionError("SIGTERM did not stop the check")
        return _measured(name)

    monkeypatch.setattr(runner, "step", steps)
    out = tmp_path / "report"
    assert main(["--model", model, "--prompts", prompts, "--out", str(out), "--fills", "zeros", "normal"]) == 143
    err = capsys.readouterr().err
    assert "kvfill-check: stopped by SIGTERM: the running step and its engine were stopped, nothing of the check is " \
           f"left running; a partial report of what was measured: {out / 'report.json'}, {out / 'report.md'}" in err
    saved = json.loads((out / "report.json").read_text())
    assert saved["partial"] == {"stopped_by": "SIGTERM", "measured": ["prefill", "zeros"], "not_measured": ["normal"]}
    assert saved["steps"]["normal"] == {"run": "normal", "error": "not run: the check was stopped by SIGTERM"}
    assert any(line.startswith("zeros: greedy tokens = real prefill's") for line in saved["verdicts"]), saved
    md = (out / "report.md").read_text()
    assert "**Partial report**: the check was stopped by SIGTERM before it ended; measured: prefill, zeros; not " \
           "measured: normal" in md
