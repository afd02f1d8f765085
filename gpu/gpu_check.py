"""One-shot GPU check: correctness on every layout x dtype, then kvfill vs memset
vs the in-tree fill at several sizes.  Needs torch + triton + kvfill only (no
vLLM, no network); prints a compact table last and writes JSON.

    python gpu/gpu_check.py --out bench/results          # on a GPU machine
    TRITON_INTERPRET=1 python gpu/gpu_check.py --smoke   # CPU dry run (tests do this)

Every case runs on its own: one that raises (a compile error, out of memory,
a CUDA error) is reported as that case's error and the check goes on; the
summary and JSON are always written, and the exit status counts it.

Correctness: each cache layout of kvfill.kernels.testing is built over a poisoned
buffer on the device, filled by the Triton kernel (partial first block, whole
block, partial last block, out of order), and every byte of the buffer is
compared with the torch backend's fill of a CPU copy (the torch backend is
checked against an independent oracle by the CPU test suite).  Modes: constant,
normal, and replay of a random bank of several sequences whose positions wrap:
where the layout's K/V heads are known (named by the view, or given as vLLM's
GPU view ``[B, H, N, 2 x head]`` is, std-*), TP rank 1's part of a canonical
bank of twice the heads, permuted into the cache's element order at staging.
CUDA graphs: a captured ``fill_blocks`` and a captured replay fill
(``FillEngine.fill_device_entries``), each replayed with new entries after its
engine's last reference was dropped.  Packed rows (``gpu_check_packed.py``):
DeepSeek's indexer pages, fp8_ds_mla and nvfp4_ds_mla rows - synthetic,
replayed and zero - in one layer, several layers per class (layer-major and
cross-layer buffers) and DCP 2, byte for byte against the torch backend.
Then ``SECTIONS``: packed classes warmed up and filled from device entries
(captured in a CUDA graph), the attention fill under DCP 2, state pages
(``gpu_check_state.py``), the Triton fill inside an Inductor-compiled step
captured in a CUDA graph, offsets past 2^32 bytes with a bank past 2^31
elements (``gpu_check_large.py``), and a bank kept in host memory against
the same bank on the device (``gpu_check_host_bank.py``).  Timings: kvfill vs
memset vs the in-tree fill, packed-row and state-page fills vs memset, a
replay fill from a device-resident and a host-kept bank vs memset.  Bandwidth
(``gpu_check_bandwidth.py``): the normal fill above and below the L2, best and
median, as a fraction of a memset and of the datasheet peak (below the L2: a
latency), a fill beside a forward-sized matmul on another stream, and the H200
goal (>= 87 % of peak), in the JSON's ``bandwidth``.  ``--smoke`` on the CPU runs
every section (CUDA graphs apart) and the timings at toy sizes.

``--budget-s``: sections that would start past it are skipped and named in the
summary (``gpu-check-summary.txt``, printed last) and the JSON, so the report
is complete whatever the time.  The order makes a short lease reach what only
a GPU can run: every layout and mode in the first dtype, then the CUDA-graph,
packed-row, device-guard and speed sections, then the other dtypes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from kvfill.bench import common as C  # noqa: E402
from kvfill.bench import fill_bench  # noqa: E402
from kvfill.gpu import gpu_check_bandwidth as BW
from kvfill.gpu.gpu_check_host_bank import check_host_bank, time_host_bank
from kvfill.gpu.gpu_check_large import check_large_offsets
from kvfill.gpu.gpu_check_packed import check_packed_capture, check_packed_rows, time_packed
from kvfill.gpu.gpu_check_sections import (
    MODES, check_attention_dcp, check_compiled_capture, check_device_guard, check_graph_capture,
    check_replay_capture, correctness, isolated,
)
from kvfill.gpu.gpu_check_state import check_state_pages, time_state_pages
from kvfill.kernels import testing as LZ

MiB = 1 << 20
# Sections after the packed rows, each a list of failed checks ([]: passed), run on any device (CUDA graphs
# and timings only on CUDA): what a GPU must show beyond the layout zoo.
SECTIONS = (
    ("packed classes: warmup, device entries, CUDA graph", check_packed_capture),
    ("attention fill under DCP 2", check_attention_dcp),
    ("state pages", check_state_pages),
    ("Inductor + CUDA graph around the Triton fill", check_compiled_capture),
    ("offsets past 2^32 bytes, a bank past 2^31 elements", check_large_offsets),
    ("a bank kept in host memory, staged per fill", check_host_bank),
)


class Budget:
    """Seconds a run may spend; ``spend(name)`` says whether a section may
    start, and records the ones that may not."""

    def __init__(self, seconds):
        self.seconds, self.start, self.skipped = seconds, time.time(), []

    def spend(self, name) -> bool:
        if self.seconds is not None and time.time() - self.start > self.seconds:
            self.skipped.append(name)
            return False
        return True


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="fill sizes (MiB)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: a dry run of the script itself")
    p.add_argument("--dtypes", nargs="+", default=None, choices=[d[0] for d in LZ.DTYPES], metavar="DTYPE",
                   help="the cache dtypes the correctness sweep covers (default: all of the layout zoo's: "
                        + ", ".join(d[0] for d in LZ.DTYPES) + ")")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip sections that would start past this many seconds (named in the summary)")
    a = p.parse_args(argv)
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)  # noqa: E731
    device = a.device
    log(f"machine: {C.machine_info(device)}")

    budget = Budget(a.budget_s)
    # Every layout and mode in one dtype first, then the CUDA-graph and speed sections, then the other
    # dtypes: a short lease always reaches the sections only a GPU can run (what was cut is named).
    rows, failures = correctness(device, log, budget, "first", a.dtypes)
    log(f"correctness, first dtype: {len(rows)} layout x mode cases, {failures} with mismatched bytes")
    errors = []  # the sections' (the correctness cases' go first in the summary)

    def attempt(name, fn, *args, **kwargs):  # isolated(), its error listed for the summary
        got, error = isolated(name, log, fn, *args, **kwargs)
        if error:
            errors.append(f"{name}: {error}")
        return got, error

    def failed_checks(name, check):  # a check that raised failed
        if not budget.spend(name):
            return None
        failed, error = attempt(name, check, device, log)
        return [f"raised {error}"] if error else failed

    graph_failed = failed_checks("CUDA graph capture of fill_blocks", check_graph_capture)
    graph_ok = None if graph_failed is None else not graph_failed
    log(f"CUDA graph capture of fill_blocks: {'n/a' if graph_ok is None else graph_ok}")
    replay_failed = failed_checks("CUDA graph capture of a replay fill", check_replay_capture)
    replay_graph_ok = None if replay_failed is None else not replay_failed
    log(f"CUDA graph capture of a replay fill: {'n/a' if replay_graph_ok is None else replay_graph_ok}")
    packed_failed = failed_checks("packed rows (DeepSeek indexer, fp8_ds_mla, nvfp4_ds_mla)", check_packed_rows)
    packed_ok = None if packed_failed is None else not packed_failed
    log(f"packed rows byte-exact: {'n/a' if packed_ok is None else packed_ok}")
    sections = {}  # name -> the failed checks' names ([]: passed), for the sections below
    for name, check in SECTIONS:
        failed = failed_checks(name, check)
        if failed is not None:
            sections[name] = failed
    guard_ok = None
    if budget.spend("device guard"):
        guard_ok, error = attempt("device guard", check_device_guard, device, log)
        guard_ok = False if error else guard_ok
    log(f"device guard (fill with another GPU current): {'n/a (one GPU)' if guard_ok is None else guard_ok}")

    sizes = [1] if a.smoke else a.sizes
    layers = 2 if a.smoke else 32
    repeat = 1 if a.smoke else 7
    perf = []
    for mib in sizes:
        for mode in ("constant", "normal", "replay"):
            if not budget.spend(f"perf {mib} MiB {mode}"):
                continue
            got, error = attempt(f"perf {mib} MiB {mode}", fill_bench.run_case, device, fill_bytes=mib * MiB,
                                 num_layers=layers, num_requests=16, mode=mode, repeat=repeat)
            perf += got or []
            if not error:
                log(f"timed {mib} MiB {mode}")
    # Packed rows (DeepSeek's sparse attention) and state pages, beside a memset of the bytes they write.
    blocks, packed_layers, state_layers, page = (2, 2, 2, 4096) if a.smoke else (512, 8, 16, 256 * 1024)
    timings = (("perf packed rows", time_packed, dict(num_blocks=blocks, layers=packed_layers)),
               ("perf state pages", time_state_pages, dict(layers=state_layers, blocks=blocks // 8 or 1,
                                                           page_bytes=page)),
               ("perf host bank", time_host_bank, dict(layers=state_layers, blocks=blocks // 2 or 1)))
    for name, timing, kw in timings:
        if budget.spend(name):
            got, error = attempt(name, timing, device, repeat=repeat, **kw)
            perf += got or []
            if not error:
                log(f"timed {name[5:]}")
    # Launch-bound step: 256 requests x 80 layers, one small block each.
    n_req, n_layers = (4, 3) if a.smoke else (256, 80)
    for mode in ("constant", "normal"):
        if not budget.spend(f"perf launch-bound {mode}"):
            continue
        got, error = attempt(f"perf launch-bound {mode}", fill_bench.run_case,
                             device, fill_bytes=0, num_layers=n_layers, num_requests=n_req, mode=mode, repeat=repeat,
                             heads=1, content=128, label=f"launch-bound R{n_req} L{n_layers}")
        perf += got or []
        if not error:
            log(f"timed launch-bound step {mode}")
    # Bandwidth vs memset and datasheet peak above and below the L2, and a fill beside a forward (issue 59).
    bandwidth, bw_repeat = BW.context(device, a.smoke), 3 if a.smoke else 20
    if budget.spend("perf bandwidth: fills above and below L2, a fill beside a forward"):
        got, _ = attempt("perf bandwidth", BW.fill_rows, device, bandwidth, layers, bw_repeat, a.smoke)
        bandwidth["rows"] = got or []
        bandwidth["overlap"], _ = attempt("perf overlap", BW.overlap, device, bandwidth, layers, bw_repeat, a.smoke)
    else:
        bandwidth["skipped_for_budget"] = True
    bandwidth["goal"] = BW.goal(bandwidth)
    log(bandwidth["goal"]["line"])
    more, more_failures = correctness(device, log, budget, "rest", a.dtypes)
    rows, failures = rows + more, failures + more_failures
    log(f"correctness: {len(rows)} layout x dtype x mode cases, {failures} with mismatched bytes")
    errors = [f"{r['layout']} {r['dtype']} {r['mode']}: {r['error']}" for r in rows if r["error"]] + errors
    # Replay's goal: >= 90% of the synthetic (normal) fill's bandwidth, size by size.
    kv = {(r["case"], r["mode"]): r for r in perf if r["impl"] == "kvfill"}
    replay_ratio = {case: round(kv[(case, "normal")]["ms"] / r["ms"], 3) if r["ms"] else None
                    for (case, mode), r in kv.items() if mode == "replay" and (case, "normal") in kv}
    log(f"replay / normal bandwidth (goal >= 0.9): {replay_ratio}")
    unverified = [r for r in perf if r["impl"] == "kvfill" and r["verified"] is not True]
    for r in unverified:
        log(f"UNVERIFIED perf row: {r['case']} {r['mode']}")
    bw_unverified = [r["case"] for r in bandwidth.get("rows", []) if r["verified"] is not True] + (
        ["fill beside a forward"] if bandwidth.get("overlap") and bandwidth["overlap"]["verified"] is not True else [])
    for case in bw_unverified:
        log(f"UNVERIFIED bandwidth row: {case}")

    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "gpu_check.json")
    C.write_json(path, {
        "machine": C.machine_info(device),
        "command": "python gpu/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": round(time.time() - t0, 1),
        "skipped_for_budget": budget.skipped,
        "errors": errors,
        "correctness": {"cases": len(rows), "failures": failures, "graph_capture": graph_ok,
                        "graph_capture_failed": graph_failed, "replay_graph_capture": replay_graph_ok,
                        "replay_graph_capture_failed": replay_failed, "device_guard": guard_ok,
                        "packed_rows": packed_ok, "packed_rows_failed": packed_failed,
                        "sections": {n: {"ok": not f, "failed": f} for n, f in sections.items()},
                        "unverified_perf_rows": len(unverified), "rows": rows},
        "perf": perf,
        "replay_over_normal_bandwidth": replay_ratio,
        "bandwidth": bandwidth,
    })
    log(f"wrote {path}")
    by_mode = {m: [r for r in rows if r["mode"] == m] for m in MODES}
    summary = [
        f"machine: {C.machine_info(device)}",
        "correctness: " + ", ".join(f"{m} {sum(r['bad_bytes'] == 0 for r in rs)}/{len(rs)}"
                                    for m, rs in by_mode.items()) + " cases byte-exact",
        f"CUDA graph capture ok: fill_blocks {_word(graph_ok)}, replay {_word(replay_graph_ok)}"
        f"; device guard ok: {_word(guard_ok, 'n/a (one GPU)')}; packed rows byte-exact: {_word(packed_ok)}",
        "sections: " + ("; ".join(f"{n} {'ok' if not f else 'FAILED'}" for n, f in sections.items()) or "none run"),
        f"perf rows verified: {sum(r['impl'] == 'kvfill' for r in perf) - len(unverified)}/"
        f"{sum(r['impl'] == 'kvfill' for r in perf)}; replay / normal bandwidth (goal >= 0.9): {replay_ratio}",
    ]
    summary += [f"MISMATCH {r['layout']} {r['dtype']} {r['mode']}: {r['bad_bytes']} bytes"
                for r in rows if r["bad_bytes"]][:8]
    if errors:
        summary.append(f"ERRORS ({len(errors)}; each case went on to the next):")
        summary += [f"  {e}" for e in errors[:12]]
    summary += [f"CUDA graph: {n}" for n in (graph_failed or []) + (replay_failed or [])]
    summary += list(packed_failed or [])
    summary += [f"{n}: {x}" for n, f in sections.items() for x in f]
    if budget.skipped:
        summary.append(f"SKIPPED for the budget ({a.budget_s:g} s): {len(budget.skipped)} sections: "
                       + "; ".join(budget.skipped))
    summary += BW.summary(bandwidth) + [f"UNVERIFIED bandwidth row: {case}" for case in bw_unverified]
    summary.append(C.table(perf, fill_bench.COLUMNS))
    text = "\n".join(summary)
    with open(os.path.join(a.out, "gpu-check-summary.txt"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)
    # Every failed check counts: a fast row whose bytes are wrong is a failure, not a figure.
    perf_errors = sum(e.startswith("perf ") for e in errors)
    return (failures + (graph_ok is False) + (replay_graph_ok is False) + (guard_ok is False) + (packed_ok is False)
            + sum(bool(f) for f in sections.values()) + len(unverified) + len(bw_unverified) + perf_errors)


def _word(ok, none="n/a"):
    return none if ok is None else str(ok)


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
