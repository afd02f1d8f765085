"""Shared pieces of the benchmarks and GPU check (torch + triton only, no vLLM).

* ``standard_views`` (from ``kvfill.kernels.testing``): vLLM's per-layer
  ``[B, H, N, C]`` views over one raw buffer in any of its six physical orders.
* ``intree_fill``: the in-tree DecodeBenchConnector fill, re-implemented
  faithfully (vLLM 0.32 ``_fill_block_tensor``): per request, per layer, an
  H2D copy of the block ids, a bounds filter, a freshly sampled
  ``torch.normal``/``torch.full`` temporary of the whole fill, clamp, cast and
  an index-put.
* ``Timer``: median wall time of a callable, synchronising the device.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import numpy as np
import torch

from kvfill.kernels.testing import standard_views  # noqa: F401  (the benches build caches with it)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project


def scattered_requests(num_requests, blocks_per_request, num_blocks, seed=0):
    """Disjoint, randomly placed block tables (like a busy block pool)."""
    need = num_requests * blocks_per_request
    if need > num_blocks:
        raise ValueError(f"{need} blocks requested from a pool of {num_blocks}")
    perm = np.random.default_rng(seed).permutation(num_blocks)[:need]
    return [perm[i * blocks_per_request : (i + 1) * blocks_per_request].tolist() for i in range(num_requests)]


def _intree_values(size, device, dtype, mean, std):
    # vLLM 0.32 DecodeBenchConnectorWorker._make_fill_values
    finfo = torch.finfo(dtype)
    if std > 0:
        sample_dtype = dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32
        values = torch.normal(mean, std, size=size, device=device, dtype=sample_dtype)
        return values.clamp_(finfo.min, finfo.max).to(dtype)
    return torch.full(size, min(max(mean, finfo.min), finfo.max), dtype=dtype, device=device)


def intree_fill(layers, requests, mean, std):
    """The in-tree fill: for each request, for each layer (``_fill_block_tensor``);
    uint8 caches hold fp8 e4m3 values, as for vLLM's ``fp8`` cache dtype."""
    for block_ids in requests:
        for kv_cache in layers:
            fill_dtype = torch.float8_e4m3fn if kv_cache.dtype == torch.uint8 else kv_cache.dtype
            ids = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
            valid = ids[ids < kv_cache.shape[0]]
            if len(valid) == 0:
                continue
            values = _intree_values((len(valid),) + kv_cache.shape[1:], kv_cache.device, fill_dtype, mean, std)
            kv_cache[valid] = values.view(kv_cache.dtype)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_time(fn, device, *, repeat=5, warmup=1, min_time=0.0):
    """Median seconds per call of ``fn`` (device synchronised around each call)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < repeat or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
        if len(times) >= 10 * repeat:
            break
    return statistics.median(times)


def rows_beside_memset(case: str, mode: str, written: int, secs: float, calls: int, memset_secs: float,
                       verified: bool) -> list[dict]:
    """gpu_check's two table rows for a fill of ``written`` bytes timed beside
    a memset of as many: kvfill's (its launches, whether its bytes were
    verified) and the memset's (fill_bench.COLUMNS)."""
    return [{"case": case, "mode": mode, "impl": impl, "MiB": round(written / 2**20, 1), "ms": round(t * 1e3, 3),
             "GB/s": round(gbps(written, t), 1), "%memset": round(100 * memset_secs / t, 1), "x in-tree": "",
             "calls": n, "extra MiB": "", "verified": verified if impl == "kvfill" else ""}
            for impl, t, n in (("kvfill", secs, calls), ("memset", memset_secs, 1))]


def peak_extra_bytes(fn, device):
    """Peak device memory allocated by ``fn`` beyond what was live before (CUDA only)."""
    if torch.device(device).type != "cuda":
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated() - before


def machine_info(device) -> dict:
    import triton

    info = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": str(device),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def cpu_features() -> dict:
    """The CPU's model name and the features vLLM CPU picks kernels and
    state dtypes by (``avx512_bf16``: float32 gated delta-net state unless
    asked otherwise; ``amx_bf16``), from /proc/cpuinfo where there is one."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {"cpu": name, **{flag: flag in flags for flag in ("avx512_bf16", "amx_bf16")}}


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


RESULT = "RESULT "  # the line a bench child process prints its JSON result on


def print_result(payload) -> None:
    """In a bench child process: its result, as the one line ``child_result`` reads."""
    print(RESULT + json.dumps(payload), flush=True)


def run_each(runs: str, run_one) -> dict:
    """In a bench child process: ``run_one(run)`` for each of the
    comma-separated ``runs``, one after another (each builds its own engine,
    so vLLM is imported once for all); run -> its result."""
    import gc

    results = {}
    for run in runs.split(","):
        results[run] = run_one(run)
        gc.collect()  # the previous engine's caches before the next one's
    return results


def run_child(cmd: list[str], what: str, *, timeout: float | None = None, env: dict | None = None
              ) -> subprocess.CompletedProcess:
    """Run a bench child process (an engine run, a recording); if it fails,
    show the tails of its output and stop, naming ``what``."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        _child_failed(out, what)
    return out


def child_result(cmd: list[str], what: str, *, timeout: float | None = None, env: dict | None = None) -> dict:
    """Run a bench child process and return the JSON of its last ``RESULT`` line."""
    out = run_child(cmd, what, timeout=timeout, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)]
    if not lines:
        _child_failed(out, what)
    return json.loads(lines[-1][len(RESULT):])


def _child_failed(out: subprocess.CompletedProcess, what: str):
    sys.stderr.write(out.stdout[-3000:] + out.stderr[-5000:])
    raise SystemExit(f"{what} failed (exit {out.returncode})")


def write_json(path, payload):
    """``payload`` as indented JSON, naming paths in the project relative to
    it (``without_machine_paths``): results name no machine's folders."""
    with open(path, "w") as f:
        f.write(without_machine_paths(json.dumps(payload, indent=2)) + "\n")


def without_machine_paths(text: str, work: str | None = None, root: str = ROOT) -> str:
    """A report's text as bench/results publishes it: paths in the project
    relative to it (``out/check-llama/prompts.txt``), the work folder
    ``<work>`` where it lies outside the project - no absolute path of the
    machine that ran the check (numbers and everything else unchanged)."""
    root = os.path.abspath(root)
    work = os.path.abspath(work) if work else None
    names = ([(work, "<work>")] if work and os.path.relpath(work, root).startswith("..") else []) + [(root, ".")]
    for folder, name in names:
        for spelled in {folder, json.dumps(folder)[1:-1]}:  # as written, and as JSON escapes it
            # the folder whole: followed by '/' or by no further character of a name (/work/main2 is another)
            whole = re.escape(spelled) + r"(/|(?![\w\-]|\.\w))"
            text = re.sub(whole, lambda m: name + m.group(1) if name != "." else "" if m.group(1) else ".", text)
    return text


def table(rows, columns) -> str:
    """Fixed-width text table of dict rows."""
    widths = {c: max([len(c)] + [len(str(r.get(c, ""))) for r in rows]) for c in columns}
    lines = ["  ".join(c.rjust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r.get(c, "")).rjust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)
