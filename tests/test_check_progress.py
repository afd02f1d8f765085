"""What kvfill-check tells a user on a busy host (issue 67): its progress
line counts a step's passes and estimates the time they have left (a step
of 6 prompts ran 13 minutes saying only "prefill: running, 690 s"),
``--time-by-class off`` times the whole run without the per-class passes,
and vLLM's warnings that bear on timing reach the report, once each.  No
engine: a stand-in step prints what measure.run's timer prints."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.cpu_only


@pytest.fixture(autouse=True)
def _vllm_platform(vllm_cpu_platform):
    """conftest's vllm_cpu_platform for every test here."""


def _classed_prompts(path) -> str:
    """Four prompts in two classes, three of "code" and one of "chat"."""
    path.write_text("".join(json.dumps({"prompt": p, "class": c}) + "\n" for p, c in
                            (("w5 w6 w7", "code"), ("w8 w9", "chat"), ("w10 w11", "code"), ("w12 w13", "code"))))
    return str(path)


def test_the_progress_line_counts_passes_and_estimates_the_time_they_have_left(tmp_path, monkeypatch):
    """A stand-in step runs 8 passes of --time-passes 3 over two classes' 24 (the first two of each group
    untimed and slower) through probes.StepTimer, the timer measure.run uses; the check's heartbeat, every
    0.5 s here, says how many are done and about how long the rest take."""
    from kvfill.check import steps
    from kvfill.check.cli import check_config

    monkeypatch.setattr(steps, "HEARTBEAT_S", 0.5)
    stand_in = ("import time; from types import SimpleNamespace as N; from kvfill.check.probes import StepTimer\n"
                "core = N(step_fn=lambda: None, scheduler=N(schedule=lambda: None))\n"
                "timer = StepTimer(N(llm_engine=N(engine_core=N(engine_core=core))), 0)\n"
                "time.sleep(1.5)\n"  # the engine's start and the greedy run
                "for i in range(8):\n"
                "    timer.on = True\n"
                "    time.sleep(0.6 if i < 2 else 0.3)\n"
                "    timer.on = False\n"
                "time.sleep(1.2)\n")
    log_file = tmp_path / "prefill.log"
    job = {"kind": "run", "run": "prefill", "ids": [[5]] * 4, "time_passes": 3,
           "classes": ["code", "chat", "code", "code"]}
    plan = steps.pass_plan(job)
    assert [share for share, _ in plan] == [1.0] * 8 + [0.75] * 8 + [0.25] * 8
    assert [untimed for _, untimed in plan[:8]] == [True, True] + [False] * 6
    lines = []
    cfg = check_config(["--model", str(tmp_path), "--prompts", __file__, "--run-timeout", "60"])
    with open(log_file, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", stand_in], stdout=out, stderr=subprocess.STDOUT)
    try:
        assert steps._wait(proc, "prefill", cfg, lines.append, steps.PassProgress(str(log_file), plan)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert lines and all(line.startswith("      prefill: running, ") for line in lines), lines
    assert any(line.endswith("; passes 0/24 done (they follow the greedy run)") for line in lines), lines
    last = lines[-1]  # all 8 done, 16 left: 8 x 0.75 + 8 x 0.25 of the whole's timed pass (0.3 s) - about 2.4 s
    assert "; passes 8/24 done, about " in last, lines
    assert 2 <= float(last.rsplit("about ", 1)[1].split()[0]) <= 5, lines


def test_time_by_class_off_times_the_whole_run_only_and_vllms_timing_warnings_reach_the_report_once(
        check_model, tmp_path, monkeypatch):
    """--time-by-class off: each run's job names no classes to time apart (8 passes, not 24), while the report
    still groups the prompts by class.  A vLLM warning that says timing suffers, logged by two steps, is in
    report.json and report.md once, naming both logs; one that does not is left out."""
    import kvfill.check.runner as runner
    from kvfill.check import report
    from kvfill.check.cli import check_config
    from kvfill.check.compare import compare_all
    from kvfill.check.steps import pass_plan
    from kvfill.check.verdict import verdicts

    model, _ = check_model
    prompts = _classed_prompts(tmp_path / "prompts.jsonl")
    slow = ("Speculative decoding on CPU without Intel OpenMP in LD_PRELOAD will cause significant performance loss. "
            "Please follow the section `set LD_PRELOAD`")
    jobs = {}

    def logged_step(name, job, cfg, i, n, log, env=None):
        if name == "record":
            return {"run": "record", "error": "exit 1: a stand-in recording (log record.log)", "step_s": 1.0}
        jobs[name] = job
        with open(os.path.join(cfg.out, "logs", f"{name}.log"), "w") as f:
            f.write(f"(EngineCore pid=7) WARNING 05-12 17:35:47 [cpu_worker.py:131] {slow}\n"
                    "WARNING 05-12 17:35:48 [cpu.py:296] Pin memory is not supported on CPU.\n")
        return {"run": name, "greedy": [{"tokens": [5, 6], "logprobs": [-0.5, -0.5]}] * 4,
                "eos": [], "counters": {}, "eos_counters": {}, "timing": {}, "step_s": 1.0}

    monkeypatch.setattr(runner, "step", logged_step)
    out = tmp_path / "report"
    cfg = check_config(["--model", model, "--prompts", prompts, "--out", str(out), "--fills", "zeros", "--time-by-class", "off", "--max-tokens", "0"])
    from kvfill.check.inputs import Inputs

    inputs = Inputs(SimpleNamespace(decode=lambda t: " ".join(map(str, t))), [[5, 6, 7], [8, 9], [10, 11], [12, 13]],
                    40, None, classes=["code", "chat", "code", "code"])
    res = runner.run_all(cfg, inputs, log=lambda line: None)
    assert jobs["prefill"]["classes"] is None and len(pass_plan(jobs["prefill"])) == 8
    assert res["prompt_classes"] == ["code", "chat", "code", "code"]
    assert res["timing_warnings"] == [{"warning": slow, "logs": ["prefill.log", "zeros.log"]}]
    cmp = compare_all(res)
    lines = verdicts(res, cmp)
    os.makedirs(out, exist_ok=True)
    paths = report.write(str(out), cfg, res, cmp, lines)
    assert json.loads(open(paths[0]).read())["timing_warnings"] == res["timing_warnings"]
    md = open(paths[1]).read()
    assert md.count(slow) == 1 and f"- {slow} (prefill.log, zeros.log)" in md and "Pin memory" not in md
    assert "- decode time per class: not measured (--time-by-class off: the whole run's passes only)" in md
    on = check_config(["--model", model, "--prompts", prompts, "--out", str(out), "--fills", "zeros"])
    runner.run_all(on, inputs, log=lambda line: None)
    assert len(pass_plan(jobs["prefill"])) == 24  # the default: the whole run's 8 and 8 per class
