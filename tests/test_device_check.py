"""gpu/device_check.sh, the one-shot GPU run, driven on the CPU with a
stand-in python: the suite runs to its end under a budget, gpu_check runs
whatever the suite did, the exit status says whether either failed, and the
summary comes last (failures by test id, then the check's table).  Then the
check's bandwidth figures (gpu/gpu_check_bandwidth.py): the datasheet peak
by GPU name, the goal's verdicts, and the figures measured on the tests'
device (on a GPU run: CUDA events, streams, the device's L2)."""
import os
import pathlib
import stat
import subprocess

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Answers like the real commands: versions, a pytest run, gpu_check; it records
# each call's arguments and the budget it was given.
FAKE_PY = r"""#!/usr/bin/env bash
echo "$* | budget=${KVFILL_TEST_BUDGET_S:-} device=${KVFILL_TEST_DEVICE:-}" >> "$CALLS"
case "$1 $2" in
  "-c "*) echo "torch 0.0 triton 0.0 stand-in";;
  "-m pytest")
    echo "FAILED tests/test_engine.py::test_fill_blocks_compiles - torch._dynamo.exc.Unsupported"
    echo "BUDGET-SKIPPED tests/test_fuzz.py: 4 tests, from test_random_plans"
    echo "1 failed, 41 passed, 4 skipped in 12.0s"
    exit "$PYTEST_RC";;
  "gpu/gpu_check.py "*)
    printf 'correctness: constant 130/130, normal 130/130, replay 130/130 cases byte-exact\n  case  mode  impl\n' \
      > "$OUT/gpu-check-summary.txt"
    echo "[   1.0s] wrote gpu_check.json"
    exit "$CHECK_RC";;
esac
"""


def run_device_check(tmp_path, pytest_rc, check_rc, fake_py=FAKE_PY):
    fake = tmp_path / "python"
    fake.write_text(fake_py)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = {**os.environ, "PY": str(fake), "OUT": str(out), "CALLS": str(tmp_path / "calls"),
           "PYTEST_RC": str(pytest_rc), "CHECK_RC": str(check_rc), "KVFILL_TEST_BUDGET_S": "30", "KVFILL_TEST_DEVICE": "",
           "PATH": os.environ["PATH"]}
    proc = subprocess.run(["bash", str(ROOT / "gpu" / "device_check.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    return proc, (tmp_path / "calls").read_text().splitlines(), out


def test_failing_tests_make_the_run_fail_and_gpu_check_still_runs(tmp_path):
    proc, calls, out = run_device_check(tmp_path, pytest_rc=1, check_rc=0)
    assert proc.returncode != 0, proc.stdout
    pytest_call = next(c for c in calls if c.startswith("-m pytest"))
    assert " -x" not in pytest_call.split("|")[0], "the suite must not stop at its first failure"
    assert "budget=30 device=cuda" in pytest_call
    assert any(c.startswith("gpu/gpu_check.py") and "--budget-s" in c for c in calls), calls
    summary = proc.stdout[proc.stdout.index("device check summary"):]
    assert "suite FAILED (pytest exit 1)" in summary
    assert "FAILED tests/test_engine.py::test_fill_blocks_compiles" in summary
    assert "BUDGET-SKIPPED tests/test_fuzz.py: 4 tests" in summary
    assert "1 failed, 41 passed, 4 skipped" in summary
    # The check's table comes last, after the failures.
    assert summary.index("FAILED tests/") < summary.index("replay 130/130 cases byte-exact")
    assert summary.rstrip().endswith("case  mode  impl")
    for phase in ("machine", "test suite", "gpu_check"):
        assert any(line.startswith(phase) and line.rstrip().split()[-1] for line in summary.splitlines())
    assert (out / "device-check-summary.txt").read_text().endswith(summary)


def test_the_suite_runs_every_test_file_once_gpu_relevant_first_compile_heavy_last(tmp_path):
    proc, calls, _ = run_device_check(tmp_path, pytest_rc=0, check_rc=0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = next(c for c in calls if c.startswith("-m pytest")).split("|")[0].split()
    files = [a for a in args if a.startswith("tests/")]
    assert sorted(files) == sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("tests/test_*.py"))
    assert files[:5] == ["tests/test_packed_rows.py", "tests/test_replay.py", "tests/test_values.py",
                         "tests/test_page_images.py", "tests/test_bank_states.py"]
    assert files[-1] == "tests/test_fuzz.py" and set(files[-3:]) >= {"tests/test_fill_layouts.py"}
    assert "skipped for the time budget (30 s), in suite order:" in proc.stdout


def test_a_run_that_skipped_nothing_says_so(tmp_path):
    fake_py = FAKE_PY.replace('echo "BUDGET-SKIPPED tests/test_fuzz.py: 4 tests, from test_random_plans"\n', "")
    assert fake_py != FAKE_PY
    proc, _, _ = run_device_check(tmp_path, pytest_rc=0, check_rc=0, fake_py=fake_py)
    assert "skipped for the time budget (30 s): none" in proc.stdout, proc.stdout


@pytest.mark.parametrize("pytest_rc, check_rc, ok", [(0, 0, True), (0, 3, False)])
def test_exit_status_counts_the_check_too(tmp_path, pytest_rc, check_rc, ok):
    proc, _, _ = run_device_check(tmp_path, pytest_rc, check_rc)
    assert (proc.returncode == 0) == ok, proc.stdout
    if not ok:
        assert f"gpu_check FAILED (exit {check_rc})" in proc.stdout


def test_the_suite_budget_skips_and_names_what_it_could_not_run(tmp_path):
    import sys

    env = {**os.environ, "KVFILL_TEST_BUDGET_S": "1e-9"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "tests/test_devices.py", "-k", "generator"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "BUDGET-SKIPPED tests/test_devices.py: 2 tests, from test_every_generator" in proc.stdout
    assert "2 skipped" in proc.stdout and "passed" not in proc.stdout


from kvfill.gpu import gpu_check_bandwidth as BW  # noqa: E402


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 4.8), ("NVIDIA H200 NVL", 4.8), ("NVIDIA H100 80GB HBM3", 3.35), ("NVIDIA H100 PCIe", 2.0),
    ("NVIDIA H100 NVL", None), ("NVIDIA B200", 7.67), ("NVIDIA GB200", None), ("NVIDIA H20", 4.0),
    ("NVIDIA A100-SXM4-80GB", 2.039), ("NVIDIA A100 80GB PCIe", 1.935), ("NVIDIA A100-SXM4-40GB", None),
    ("NVIDIA GeForce RTX 4090", None), (None, None)])
def test_the_datasheet_peak_follows_the_gpus_name(name, peak):
    assert BW.peak_tbps(name) == peak


def _bw(gpu, *rows, skipped=False):
    """The section's report as goal() reads it: rows of (MiB, median GB/s, verified)."""
    peak = BW.peak_tbps(gpu)
    return {"gpu": gpu, "peak_TBps": peak, "skipped_for_budget": skipped, "rows": [
        {"MiB": mib, "median GB/s": gbs, "verified": ok, "%peak median": gbs and peak and round(gbs / peak / 10, 1),
         "%peak best": gbs and peak and round(gbs / peak / 10, 1)} for mib, gbs, ok in rows]}


@pytest.mark.parametrize("bw, status, detail", [
    (_bw(None), "not measurable", "no GPU"),
    (_bw("NVIDIA H200", skipped=True), "not measurable", "skipped for the budget"),
    (_bw("NVIDIA H100 NVL", (800, 3000.0, True)), "not measurable", "no datasheet peak for NVIDIA H100 NVL"),
    (_bw("NVIDIA H200", (12, None, True)), "not measurable", "no fill above the L2 ran"),
    # the largest fill above the L2 decides, by its median: 4300 GB/s is 89.6 % of 4.8 TB/s
    (_bw("NVIDIA H200", (12, None, True), (200, 3000.0, True), (800, 4300.0, True)), "met", "89.6 % median"),
    (_bw("NVIDIA H200", (200, 4500.0, True), (800, 4100.0, True)), "not met", "85.4 % median"),
    (_bw("NVIDIA H200", (800, 4300.0, False)), "not measurable", "did not verify"),
    (_bw("NVIDIA B200", (800, 7000.0, True)), "met", "(the goal is set on an H200)"),
])
def test_the_goal_is_met_not_met_or_not_measurable(bw, status, detail):
    got = BW.goal(bw)
    assert got["status"] == status and detail in got["detail"], got
    assert got["line"].startswith("goal: on an H200, the fill >= 87% of the datasheet peak") and status in got["line"]


def test_the_bandwidth_figures_on_the_tests_device():
    """Toy sizes either side of the L2 (the device's on CUDA, an assumed one
    elsewhere) and a fill beside a matmul, on the tests' device: a latency
    below the L2, a bandwidth above it, fractions of the peak only where the
    GPU has one, every fill verified; overlapped on another stream on CUDA
    only; the summary says what it was measured against and the goal."""
    from conftest import DEVICE

    cuda = torch.device(DEVICE).type == "cuda"
    ctx = BW.context(DEVICE, smoke=True)
    assert (ctx["gpu"] is not None) == cuda and ctx["l2_bytes"] > 0
    assert ctx["l2_source"] == "device properties" if cuda else ctx["l2_source"].startswith("assumed: no GPU")
    rows = BW.fill_rows(DEVICE, ctx, layers=2, repeat=2, smoke=True)
    below, above = rows
    assert below["size"] == "below L2: latency" and below["median GB/s"] is None and below["%peak median"] is None
    assert below["MiB"] * 2**20 <= ctx["l2_bytes"] < above["MiB"] * 2**20 and above["size"] == "above L2"
    assert 0 < above["best us"] <= above["median us"] and above["best GB/s"] >= above["median GB/s"] > 0
    assert (above["%peak median"] is None) == (ctx["peak_TBps"] is None)
    assert all(r["verified"] is True and r["%memset median"] > 0 for r in rows)
    pair = BW.overlap(DEVICE, ctx, layers=2, repeat=2, smoke=True)
    assert pair["overlapped"] == cuda and pair["verified"] is True
    assert (pair["fill hidden (median)"] is None) != cuda and (cuda or "not overlapped" in pair["how"])
    assert all(pair["us"][k]["best"] > 0 for k in ("fill", "forward", "pair"))
    bw = {**ctx, "rows": rows, "overlap": pair}
    bw["goal"] = BW.goal(bw)
    assert (bw["goal"]["status"] == "not measurable") == (not cuda or ctx["peak_TBps"] is None)
    text = "\n".join(BW.summary(bw))
    assert f"L2 {ctx['l2_bytes'] / 2**20:g} MiB" in text and "below L2: latency" in text and "%peak median" in text
    assert ("no peak" in text) == (ctx["peak_TBps"] is None) and "fill beside a forward" in text
    assert text.splitlines()[-1] == bw["goal"]["line"]
