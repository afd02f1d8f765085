"""make test's vLLM 0.34 lane holds to what it says it runs: an overlay
that is not whole is rebuilt, a run told to expect vLLM 0.34.0 from the
overlay refuses to start on any other, and a wheel that cannot be had is
reported as such (exit 3: make test then skips the lane, saying why)."""
import os
import pathlib
import subprocess
import sys

import vllm034_overlay as overlay

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _overlay(folder: pathlib.Path, *, stamp=True, package=True, metadata=True) -> pathlib.Path:
    if stamp:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ".installed").write_text(overlay.VERSION + "\n")
    if package:
        (folder / "vllm").mkdir(parents=True, exist_ok=True)
        (folder / "vllm" / "__init__.py").write_text("")
    if metadata:
        info = folder / f"vllm-{overlay.VERSION}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {overlay.VERSION}\n")
    return folder


def test_an_overlay_is_whole_only_with_its_stamp_package_and_metadata(tmp_path):
    assert overlay.whole(str(_overlay(tmp_path / "all")))
    for part in ("stamp", "package", "metadata"):
        assert not overlay.whole(str(_overlay(tmp_path / part, **{part: False}))), part
    (tmp_path / "all" / ".installed").write_text("0.33.0\n")
    assert not overlay.whole(str(tmp_path / "all"))


def test_a_wheel_that_cannot_be_had_exits_3_naming_why(tmp_path):
    """No index reachable and no cache (an offline machine): exit 3 and pip's
    reason; a stamp-only overlay is not taken as whole meanwhile."""
    folder = _overlay(tmp_path / "broken", package=False, metadata=False)
    env = {**os.environ, "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_NO_CACHE_DIR": "1",
           "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm034_overlay.py"), str(folder)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == overlay.UNAVAILABLE, out.stderr[-2000:]
    assert "is not whole" in out.stderr and "cannot be downloaded" in out.stderr, out.stderr[-2000:]


def test_a_lane_that_would_import_another_vllm_refuses_to_start(tmp_path):
    """KVFILL_VLLM_EXPECT names 0.34.0 from a folder this run does not
    import vLLM from (this venv's own vLLM): pytest stops before any test,
    naming the vLLM it found and where."""
    env = {**os.environ, "KVFILL_VLLM_EXPECT": f"{overlay.VERSION}@{tmp_path}"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          "--collect-only", "tests/test_vllm034_lane.py"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0, out.stdout[-2000:]
    text = out.stdout + out.stderr
    assert f"not vLLM {overlay.VERSION} from under {tmp_path}" in text and "this run imports vLLM" in text, text[-2000:]
