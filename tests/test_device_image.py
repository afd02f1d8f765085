"""The suite as the first GPU run sees it, on the CPU: in a stand-in for the
device image (``tests/device_image.py``: torch, triton, pytest, hypothesis,
safetensors, numpy, transformers, pytest-benchmark, psutil; no vLLM; kvfill
not installed) with kvfill put on the path by the same code as
``gpu/device_check.sh`` (``gpu/device_env.sh``).

There, the GPU run's own selection (``gpu/device_check.sh --suite-only``:
its files in its order, its environment - no ``TRITON_INTERPRET``, no
budget here - but for the device, stood in by ``KVFILL_TEST_DEVICE=cpu:0``)
must collect whole, every test that needs vLLM must skip, and nothing else
may fail with the tests' device a device of its own (``tests/device_rule.py``:
torch's default device apart from host memory, mixing the two an error and a
Triton launch over host memory refused, as on CUDA); banks
must load into host memory while torch's default device is not the CPU
(``meta`` stands in for ``cuda``).  The inner runs set
``KVFILL_IN_DEVICE_IMAGE``, so this file does not run itself.
"""
import os
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

import device_image

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.cpu_only,  # the GPU run is the device image itself
    pytest.mark.e2e,
    pytest.mark.xdist_group("device_image"),  # one worker: the module's fixtures run the image's suite once
    pytest.mark.skipif(bool(os.environ.get("KVFILL_IN_DEVICE_IMAGE")), reason="already inside the device image"),
]


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """The image's python and a folder for the shim."""
    base = tmp_path_factory.mktemp("device-image")
    return device_image.build(str(base / "venv")), base


def in_image(image, *args, env=None, timeout=1200):
    """``args`` run in the device image, with kvfill on the path as
    device_check.sh puts it there (gpu/device_env.sh)."""
    python, base = image
    site = base / f"site-{len(list(base.iterdir()))}"
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    environ.update(TRITON_INTERPRET="1", KVFILL_IN_DEVICE_IMAGE="1", **(env or {}))
    script = 'source gpu/device_env.sh && kvfill_device_env "$1" && shift && exec "$@"'
    return subprocess.run(["bash", "-c", script, "device-image", str(site), python, *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=timeout)


def test_the_image_has_no_vllm_and_kvfill_only_from_the_shim(image):
    """The stand-in itself: what the device lacks is absent, what it has is there."""
    code = ("import importlib.util as u, importlib.metadata as md, kvfill, kvfill.record, torch, triton, "
            "hypothesis, safetensors, numpy\n"
            "print([u.find_spec(m) is None for m in ('vllm', 'xdist', 'transformers', 'pytest_benchmark')])\n"
            "print(list(kvfill.__path__))\n"
            "import sysconfig; site = [sysconfig.get_paths()['purelib']]\n"
            "print([d.metadata['Name'] for d in md.distributions(path=site) if d.metadata['Name'] == 'kvfill'])\n")
    out = in_image(image, "-c", code, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    absent, path, dists = out.stdout.strip().splitlines()
    assert absent == "[True, True, False, False]"  # no vLLM, no pytest-xdist; transformers, pytest-benchmark
    assert str(image[1]) in path and str(ROOT) not in path, path  # the shim's namespace, not the repo
    assert dists == "[]"


def node_ids(text: str) -> set[str]:
    return {line.strip() for line in text.splitlines() if "::" in line and not line.startswith(("SKIPPED", "ERROR"))}


def function_ids(text: str) -> set[str]:
    """Node ids without their parameters: without vLLM the layout zoo's
    ``vllm-*`` cases are the same geometries built by kvfill (``std-*``,
    tests/cases.py), so parameter ids differ by design; functions may not."""
    return {n.split("[", 1)[0] for n in node_ids(text)}


def junit_function_id(classname: str, name: str) -> str:
    """A JUnit test case's node id without parameters: ``tests.test_x`` or
    ``tests.test_x.TestC`` and ``name[params]`` -> ``tests/test_x.py[::TestC]::name``."""
    parts = classname.split(".")
    for k in range(len(parts), 0, -1):
        if (ROOT / ("/".join(parts[:k]) + ".py")).is_file():
            return "::".join(["/".join(parts[:k]) + ".py", *parts[k:], name.split("[", 1)[0]])
    return f"{classname}::{name.split('[', 1)[0]}"


@pytest.fixture(scope="module")
def outer(tmp_path_factory):
    """The suite as it collects here, with vLLM: its output and the node ids
    marked needs_vllm (conftest writes them where KVFILL_LIST_NEEDS_VLLM says)."""
    listing = tmp_path_factory.mktemp("outer") / "needs_vllm.txt"
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "KVFILL_LIST_NEEDS_VLLM": str(listing)})
    assert out.returncode == 0, out.stdout[-3000:]
    return out.stdout, {line for line in listing.read_text().splitlines() if line}


def gpu_run_suite(image, out, timeout=1500):
    """``gpu/device_check.sh --suite-only`` with the image's python, as the
    GPU run runs it but for the device (the stand-in, ``cpu:0``), the time
    budget (none) and the fuzz count: the run, its JUnit test cases and its
    log."""
    python, _ = image
    environ = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET", "KVFILL_TEST_DEFAULT_DEVICE")}
    environ.update(PY=python, OUT=str(out), KVFILL_IN_DEVICE_IMAGE="1", KVFILL_TEST_DEVICE="cpu:0",
                   KVFILL_TEST_BUDGET_S="0", KVFILL_FUZZ_EXAMPLES="20")
    run = subprocess.run(["bash", "gpu/device_check.sh", "--suite-only"], cwd=ROOT, env=environ,
                         capture_output=True, text=True, timeout=timeout)
    report = pathlib.Path(out) / "gpu-tests.xml"
    cases = {f"{c.get('classname')}::{c.get('name')}": c for c in ET.parse(report).iter("testcase")} \
        if report.exists() else {}
    return run, cases, (pathlib.Path(out) / "gpu-tests.log").read_text() if report.exists() else ""


@pytest.fixture(scope="module")
def inner(image, tmp_path_factory):
    """The GPU run's selection run once in the image on the accelerator
    stand-in (``gpu_run_suite``): the run (its log as stdout), and its JUnit
    test cases by ``classname::name``."""
    run, cases, log = gpu_run_suite(image, tmp_path_factory.mktemp("inner"))
    run.stdout = log + run.stdout
    return run, cases


def test_the_whole_suite_collects_in_the_image(inner, outer):
    """Every test function collects there, or its module skips for vLLM; a
    collection error stops a pytest run before any test runs."""
    run, cases = inner
    assert "ERROR collecting" not in run.stdout and cases, run.stdout[-4000:] + run.stderr[-2000:]
    skipped_modules = set(re.findall(r"^SKIPPED \[\d+\] (tests/\S+\.py):\d+: could not import 'vllm",
                                     run.stdout, re.M))
    ran = {junit_function_id(*key.split("::", 1)) for key in cases}
    missing = {n for n in function_ids(outer[0]) - ran if n.split("::")[0] not in skipped_modules}
    assert not missing, sorted(missing)[:20]


def test_the_suite_passes_in_the_image_with_every_vllm_test_skipped(inner, outer):
    """The whole suite there: no failure, no error; every test marked
    needs_vllm skipped for that reason."""
    run, cases = inner
    assert run.returncode == 0, run.stdout[-6000:]
    assert len(cases) > 1000
    want = outer[1]
    assert len(want) >= 20, sorted(want)[:5]
    for node in want:
        path, name = node.split("::", 1)
        case = cases.get(f"{path.removesuffix('.py').replace('/', '.')}::{name}")
        assert case is not None, node
        skipped = case.find("skipped")
        assert skipped is not None and "needs vLLM" in skipped.get("message", ""), node


def test_banks_load_into_host_memory_and_the_device_rule_holds_with_a_non_cpu_default_device(image, tmp_path):
    """The bank file tests and the accelerator stand-in's own tests with
    torch's default device ``meta`` (tensor factories follow it, as they
    follow ``cuda`` in the GPU run): every one runs and passes."""
    report = tmp_path / "junit.xml"
    inner = in_image(image, "-m", "pytest", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={report}",
                     "tests/test_bank_files.py", "tests/test_device_rule.py",
                     env={"KVFILL_TEST_DEFAULT_DEVICE": "meta"}, timeout=600)
    assert inner.returncode == 0, inner.stdout[-4000:]
    cases = list(ET.parse(report).iter("testcase"))
    rule = [c for c in cases if c.get("classname") == "tests.test_device_rule"]
    assert len(rule) >= 3 and len(cases) > len(rule), [c.get("name") for c in cases]
    ran = [c for c in cases if c.find("skipped") is None and c.find("failure") is None and c.find("error") is None]
    assert all(c in ran for c in rule), [c.get("name") for c in rule if c not in ran]


def test_a_host_kept_bank_writes_a_device_banks_bytes_on_the_stand_in_with_a_non_cpu_default_device(image, tmp_path):
    """Banks kept in host memory (kernels/staging.py) on the accelerator
    stand-in with torch's default device ``meta``: the bank and the pinned
    staging stay host tensors, the caches and the device staging are on the
    device, and every fill's bytes equal a device-resident bank's."""
    report = tmp_path / "junit.xml"
    inner = in_image(image, "-m", "pytest", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={report}",
                     "tests/test_host_bank.py", "-k", "at_once or dcp or several_groups or permuted or chunks",
                     env={"KVFILL_TEST_DEVICE": "cpu:0", "KVFILL_TEST_DEFAULT_DEVICE": "meta"}, timeout=600)
    assert inner.returncode == 0, inner.stdout[-4000:]
    cases = list(ET.parse(report).iter("testcase"))
    ran = [c for c in cases if c.find("skipped") is None and c.find("failure") is None and c.find("error") is None]
    assert len(ran) >= 15 and len(ran) == len(cases), [c.get("name") for c in cases if c not in ran]


def test_gpu_check_runs_every_section_byte_exact_in_the_image_on_the_device_stand_in(image, tmp_path):
    """``gpu/gpu_check.py --smoke`` as device_check.sh runs it on CUDA, in
    the image, on the accelerator stand-in (device ``cpu:0``,
    ``tests/device_rule.py``: a host tensor mixed with the device's raises):
    every layout x mode in four dtypes (float, bf16, fp8 in bytes, zero-
    filled bytes: tests/test_fill_layouts.py holds every dtype on the CPU),
    the packed rows, every section and the timings at toy sizes, byte-exact;
    the summary and JSON say so."""
    import json

    from kvfill.gpu import gpu_check

    out = tmp_path / "out"
    run = in_image(image, "tests/device_rule.py", "gpu/gpu_check.py", "--smoke", "--device", "cpu:0",
                   "--dtypes", "fp32", "bf16", "u8-fp8e4m3", "u8-packed", "--out", str(out), timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    assert "'device': 'cpu:0'" in run.stdout
    assert "correctness: constant 52/52, normal 52/52, replay 52/52 cases byte-exact" in run.stdout
    assert "perf rows verified: 15/15" in run.stdout and "packed rows byte-exact: True" in run.stdout
    assert "sections: " + "; ".join(f"{name} ok" for name, _ in gpu_check.SECTIONS) in run.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["errors"] == [] and report["skipped_for_budget"] == []
    assert report["correctness"]["sections"] == {name: {"ok": True, "failed": []} for name, _ in gpu_check.SECTIONS}
    assert list(report["replay_over_normal_bandwidth"]) == ["1MiB L2 R16"] + [
        f"packed {kind} L2 B2" for kind in ("indexer", "fp8_ds_mla", "nvfp4_ds_mla")]
    assert {r["case"] for r in report["perf"]} >= {"state pages L2 x1 4KiB", "packed indexer L2 B2",
                                                    "launch-bound R4 L3", "bank on host L2 B1"}
    # The summary file device_check.sh prints last: the same lines and the table.
    summary = (out / "gpu-check-summary.txt").read_text()
    assert "replay 52/52 cases byte-exact" in summary and "launch-bound R4 L3" in summary
    assert {r["dtype"] for r in report["correctness"]["rows"]} == {"fp32", "bf16", "u8-fp8e4m3", "u8-packed"}


def test_a_test_that_builds_triton_over_its_own_stand_in_fails_the_gpu_runs_selection(image, tmp_path):
    """The check above can fail: test_device_ledger.py's engine tests build
    Triton engines over a stand-in of their own, which is host memory on the
    GPU run.  Unmarked (a copy of tests/ without its ``cpu_only`` mark), they
    fail in the image as they would on the lent GPU, refused at launch."""
    import shutil

    tests = tmp_path / "tests"
    shutil.copytree(ROOT / "tests", tests, ignore=shutil.ignore_patterns("__pycache__"))
    ledger = tests / "test_device_ledger.py"
    text = ledger.read_text()
    assert "\npytestmark = pytest.mark.cpu_only\n" in text
    ledger.write_text(text.replace("\npytestmark = pytest.mark.cpu_only\n", "\n"))
    python, base = image
    site = base / "site-unmarked"
    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET")}
    environ.update(KVFILL_IN_DEVICE_IMAGE="1", KVFILL_TEST_DEVICE="cpu:0")
    script = 'source gpu/device_env.sh && kvfill_device_env "$1" && shift && exec "$@"'
    run = subprocess.run(["bash", "-c", script, "device-image", str(site), python, "-m", "pytest", "-q",
                          "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(ledger), "-k",
                          "fill_step_makes_no_host_sync"], cwd=ROOT, env=environ, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 1, run.stdout[-3000:]
    assert "5 failed" in run.stdout and "cannot be accessed from Triton (cpu tensor?)" in run.stdout, \
        run.stdout[-3000:]
