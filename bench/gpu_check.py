"""One-shot GPU check: correctness on every layout x dtype, then kvfill vs memset
vs the in-tree fill at several sizes.  Needs torch + triton + kvfill only (no
vLLM, no network); prints a compact table last and writes JSON.

    python bench/gpu_check.py --out bench/results          # on a GPU machine
    TRITON_INTERPRET=1 python bench/gpu_check.py --smoke   # CPU dry run (tests do this)

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
engine's last reference was dropped.

``--budget-s``: sections that would start past it are skipped and named in the
summary (``gpu-check-summary.txt``, printed last) and the JSON, so the report
is complete whatever the time.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

from kvfill.bench import common as C  # noqa: E402
from kvfill.bench import fill_bench  # noqa: E402
from kvfill.kernels import testing as LZ  # noqa: E402

from kvfill.kernels import CacheGroup, FillEngine, GroupFill, fill_blocks  # noqa: E402

MiB = 1 << 20
SLOT_ENTRIES = [(4, 3, 8, 0), (1, 0, 8, 8), (5, 0, 2, 16)]
STATE_ENTRIES = [(4, 0, 1, 7), (2, 0, 1, 9)]
# Replay: a sequence per entry; a ragged bank of sequences of BANK_LENGTHS
# positions, the entries reach position 18, so rows past each one's length wrap.
BANK_LENGTHS = (11, 7, 13)
REPLAY_SLOT_ENTRIES = [(4, 3, 8, 0, 2), (1, 0, 8, 8, 0), (5, 0, 2, 16, 1)]
REPLAY_STATE_ENTRIES = [(4, 0, 1, 7, 1), (2, 0, 1, 9, 2)]


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


def _engine(layers, case, encoding, backend, std, bank=None):
    group = CacheGroup(
        layers, num_blocks=LZ.NUM_BLOCKS, block_dim=case.block_dim, slot_dim=case.slot_dim, encoding=encoding,
        kv=case.kv,
    )
    return FillEngine({"g": group}, mean=0.25, std=std, seed=11, backend=backend, bank=bank)


def random_bank(engine, dtype, seed=7):
    """Random bits per layer of a (bank-less) engine, in ``dtype``, on the
    host (replay moves bits, it never decodes them; the replaying engine
    uploads its copy): where every layer names its K/V heads, TP rank 1's part
    of a canonical bank of twice the heads (``BankPart``: the slice a rank of
    a TP 2 engine loads, staging permuting it into the cache's order), else a
    bank of the layers' own rows; ``[sum(BANK_LENGTHS), row]`` each."""
    from kvfill.bank import Bank, BankPart

    g = torch.Generator(device="cpu").manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype, device="cpu").element_size()
    formats = engine.row_formats()
    sliced = all(f.kv is not None for f in formats.values())
    layers, kv = {}, {}
    for name, fmt in formats.items():
        row = sum(math.prod(p) for p in fmt.parts) * (2 if sliced else 1)
        raw = torch.randint(0, 256, (sum(BANK_LENGTHS) * row * itemsize,), dtype=torch.uint8, generator=g,
                            device="cpu")
        layers[name] = raw.view(dtype).view(sum(BANK_LENGTHS), row)
        kv[name] = (2 * fmt.kv[0], *fmt.kv[1:]) if sliced else fmt.kv
    bank = Bank(layers, sequence_lengths=BANK_LENGTHS, kv=kv)
    return bank.select(BankPart(tp_rank=1, tp_size=2)) if sliced else bank


def check_case(case, dtype, encoding, device, mode):
    """Bytes of the whole buffer that differ between the Triton fill on the
    device and the torch backend's fill of a host copy (0: byte-exact)."""
    itemsize = torch.empty((), dtype=dtype, device="cpu").element_size()
    g = torch.Generator(device="cpu").manual_seed(99)
    host = torch.randint(0, 256, (case.nbytes(itemsize),), dtype=torch.uint8, generator=g, device="cpu")
    dev = host.to(device, copy=True)  # a copy even on the CPU (smoke runs)
    std = 0.0 if mode == "constant" else 1.0
    bank = None
    if mode == "replay":
        entries = REPLAY_STATE_ENTRIES if case.state_list else REPLAY_SLOT_ENTRIES
        bank = random_bank(_engine(case.make(host.clone(), dtype), case, encoding, "torch", std), dtype)
    else:
        entries = STATE_ENTRIES if case.state_list else SLOT_ENTRIES
    plan = {"g": GroupFill(*zip(*entries))}
    _engine(case.make(dev, dtype), case, encoding, "triton", std, bank).fill(plan)
    _engine(case.make(host, dtype), case, encoding, "torch", std, bank).fill(plan)
    got = dev.cpu()
    bad = int((got != host).sum())
    return bad


MODES = ("constant", "normal", "replay")


def isolated(name, log, fn, *args, **kwargs):
    """``(fn(...), None)``, or ``(None, error)`` where it raised: one case's
    compile error, out-of-memory or CUDA error is that case's result, and the
    check goes on to the next."""
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:  # noqa: BLE001  (every failure is reported, none ends the run)
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        log(f"ERROR {name}: {error}")
        return None, error


def correctness(device, log, budget):
    """A row per layout x dtype x mode: ``bad_bytes`` (0: byte-exact; None:
    it raised, ``error`` says what); failures counts both."""
    rows, failures = [], 0
    for case in LZ.CASES:
        for mode in MODES:
            if not budget.spend(f"correctness {case.name} {mode} (all dtypes)"):
                continue
            for dname, dtype, encoding in LZ.DTYPES:
                bad, error = isolated(f"{case.name} {dname} {mode}", log, check_case, case, dtype, encoding, device,
                                      mode)
                failures += bad != 0
                if bad:
                    log(f"MISMATCH {case.name} {dname} {mode}: {bad} bytes")
                rows.append({"layout": case.name, "dtype": dname, "mode": mode, "bad_bytes": bad, "error": error})
    return rows, failures


def check_graph_capture(device, log):
    """fill_blocks captured in a CUDA graph (kvfill.kernels.capture), replayed
    with new ids after the engine cache was cleared and refilled: the same
    bytes as the host path (repeated id: first position wins; ids past the
    caches and past int32 skipped), and host ids refused under capture.
    Returns the failed checks' names; None where not CUDA."""
    if torch.device(device).type != "cuda":
        return None
    from kvfill.kernels import clear_engine_cache, release_captured_fills

    failed = []
    cache = torch.zeros(16, 2, 8, 32, dtype=torch.bfloat16, device=device)
    ids = torch.tensor([3, 7, 3, 9], device=device)
    kw = dict(mean=0.0, std=1.0, seed=5)
    fill_blocks([cache], ids, **kw)  # warm-up: registers the engine
    torch.cuda.synchronize()
    cache.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fill_blocks([cache], ids, **kw)
        try:
            fill_blocks([cache], [3, 7], **kw)
            failed.append("host ids accepted under capture")
        except RuntimeError:
            pass
    # Evict every cached engine: the captured fill's must stay alive.
    for i in range(10):
        fill_blocks([torch.zeros(4, 1, 8, 32, device=device)], [i % 4], **kw)
    clear_engine_cache()
    torch.cuda.empty_cache()
    ids.copy_(torch.tensor([1, 2**32 + 1, 1, 99], device=device))  # repeat, past int32, past the caches
    graph.replay()
    torch.cuda.synchronize()
    ref = torch.zeros(16, 2, 8, 32, dtype=torch.bfloat16)
    fill_blocks([ref], [1], **kw, backend="torch")
    if not torch.equal(cache.cpu().view(torch.int16), ref.view(torch.int16)):
        failed.append("replayed bytes differ from the host path")
    del graph
    release_captured_fills()
    for name in failed:
        log(f"CUDA graph: {name}")
    return failed


def check_replay_capture(device, log):
    """A replay fill captured in a CUDA graph through a user-held engine
    (``fill_device_entries``: the plan on the device), replayed with new
    entries after the user's last reference to the engine was dropped and
    the engine cache cleared: the same bytes as the torch backend's host
    fill of the new plan (sequences, positions that wrap).  Returns the
    failed checks' names; None where not CUDA."""
    if torch.device(device).type != "cuda":
        return None
    import gc
    import weakref

    from kvfill.kernels import clear_engine_cache, release_captured_fills

    case = next(c for c in LZ.CASES if c.name == "std-LBNHC")
    dtype = torch.bfloat16
    failed = []
    host = torch.zeros(case.nbytes(2), dtype=torch.uint8, device="cpu")
    dev = host.to(device, copy=True)  # a copy even on the CPU (smoke runs)
    bank = random_bank(_engine(case.make(host.clone(), dtype), case, "auto", "torch", 0.0), dtype)
    eng = _engine(case.make(dev, dtype), case, "auto", "triton", 0.0, bank)
    eng.warmup()
    entries = torch.tensor([[1, 0, 8, 0, 0], [3, 2, 6, 8, 1]], dtype=torch.int32, device=device)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eng.fill_device_entries("g", entries)
    alive = weakref.ref(eng)
    del eng
    clear_engine_cache()
    gc.collect()
    torch.cuda.empty_cache()
    if alive() is None:
        failed.append("the captured replay fill's engine was freed with its last user reference")
    new = [(4, 3, 8, 0, 2), (1, 0, 8, 8, 0), (5, 0, 2, 16, 1)]  # positions up to 18 of 11: wrap
    entries.copy_(torch.tensor(new, dtype=torch.int32, device=device)[:2])
    graph.replay()
    torch.cuda.synchronize()
    _engine(case.make(host, dtype), case, "auto", "torch", 0.0, bank).fill({"g": GroupFill(*zip(*new[:2]))})
    if not torch.equal(dev.cpu(), host):
        failed.append("replayed bytes differ from the host replay fill")
    del graph
    release_captured_fills()
    for name in failed:
        log(f"CUDA graph (replay): {name}")
    return failed


def check_device_guard(device, log):
    """With a second GPU current, a fill of caches on the first still lands
    there, ordered after its plan upload.  None with fewer than two GPUs."""
    if torch.device(device).type != "cuda" or torch.cuda.device_count() < 2:
        return None
    cache = torch.zeros(8, 2, 8, 32, dtype=torch.bfloat16, device="cuda:0")
    eng = FillEngine({"g": CacheGroup({"l": cache})}, mean=0.0, std=1.0, seed=3)
    plan = {"g": GroupFill(block_ids=[2, 5])}
    with torch.cuda.device(1):
        eng.fill(plan)
    torch.cuda.synchronize(0)
    ok = eng.verify(plan).ok
    if not ok:
        log("device guard: a fill issued with cuda:1 current missed cuda:0's caches")
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="fill sizes (MiB)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: a dry run of the script itself")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip sections that would start past this many seconds (named in the summary)")
    a = p.parse_args(argv)
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)  # noqa: E731
    device = a.device
    log(f"machine: {C.machine_info(device)}")

    budget = Budget(a.budget_s)
    rows, failures = correctness(device, log, budget)
    log(f"correctness: {len(rows)} layout x dtype x mode cases, {failures} with mismatched bytes")
    errors = [f"{r['layout']} {r['dtype']} {r['mode']}: {r['error']}" for r in rows if r["error"]]

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
    # Replay's goal: >= 90% of the synthetic (normal) fill's bandwidth, size by size.
    kv = {(r["case"], r["mode"]): r for r in perf if r["impl"] == "kvfill"}
    replay_ratio = {case: round(kv[(case, "normal")]["ms"] / r["ms"], 3) if r["ms"] else None
                    for (case, mode), r in kv.items() if mode == "replay" and (case, "normal") in kv}
    log(f"replay / normal bandwidth (goal >= 0.9): {replay_ratio}")
    unverified = [r for r in perf if r["impl"] == "kvfill" and r["verified"] is not True]
    for r in unverified:
        log(f"UNVERIFIED perf row: {r['case']} {r['mode']}")

    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "gpu_check.json")
    C.write_json(path, {
        "machine": C.machine_info(device),
        "command": "python bench/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "seconds": round(time.time() - t0, 1),
        "skipped_for_budget": budget.skipped,
        "errors": errors,
        "correctness": {"cases": len(rows), "failures": failures, "graph_capture": graph_ok,
                        "graph_capture_failed": graph_failed, "replay_graph_capture": replay_graph_ok,
                        "replay_graph_capture_failed": replay_failed, "device_guard": guard_ok,
                        "unverified_perf_rows": len(unverified), "rows": rows},
        "perf": perf,
        "replay_over_normal_bandwidth": replay_ratio,
    })
    log(f"wrote {path}")
    by_mode = {m: [r for r in rows if r["mode"] == m] for m in MODES}
    summary = [
        f"machine: {C.machine_info(device)}",
        "correctness: " + ", ".join(f"{m} {sum(r['bad_bytes'] == 0 for r in rs)}/{len(rs)}"
                                    for m, rs in by_mode.items()) + " cases byte-exact",
        f"CUDA graph capture ok: fill_blocks {_word(graph_ok)}, replay {_word(replay_graph_ok)}"
        f"; device guard ok: {_word(guard_ok, 'n/a (one GPU)')}",
        f"perf rows verified: {sum(r['impl'] == 'kvfill' for r in perf) - len(unverified)}/"
        f"{sum(r['impl'] == 'kvfill' for r in perf)}; replay / normal bandwidth (goal >= 0.9): {replay_ratio}",
    ]
    summary += [f"MISMATCH {r['layout']} {r['dtype']} {r['mode']}: {r['bad_bytes']} bytes"
                for r in rows if r["bad_bytes"]][:8]
    if errors:
        summary.append(f"ERRORS ({len(errors)}; each case went on to the next):")
        summary += [f"  {e}" for e in errors[:12]]
    summary += [f"CUDA graph: {n}" for n in (graph_failed or []) + (replay_failed or [])]
    if budget.skipped:
        summary.append(f"SKIPPED for the budget ({a.budget_s:g} s): {len(budget.skipped)} sections: "
                       + "; ".join(budget.skipped))
    summary.append(C.table(perf, fill_bench.COLUMNS))
    text = "\n".join(summary)
    with open(os.path.join(a.out, "gpu-check-summary.txt"), "w") as f:
        f.write(text + "\n")
    print("\n" + text)
    # Every failed check counts: a fast row whose bytes are wrong is a failure, not a figure.
    perf_errors = sum(e.startswith("perf ") for e in errors)
    return (failures + (graph_ok is False) + (replay_graph_ok is False) + (guard_ok is False)
            + len(unverified) + perf_errors)


def _word(ok, none="n/a"):
    return none if ok is None else str(ok)


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
