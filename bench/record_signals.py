"""A real TP 2 recording on vLLM CPU, stopped by a signal mid-run, and what it
leaves: ``kvfill-record`` (the tiny Llama, two workers, one core each) run
three ways - to the end, SIGTERM to the recorder, and SIGINT to its whole
process group (a terminal's Ctrl-C) - each signal sent once the workers have
saved their first prompt's rows.  Per run: the exit status, the recorder's
last line, and what is left: the bank, work folders beside it, vLLM's
rendezvous files and shared-memory segments, the workers' parts folders,
and processes of the run's session.  Everything but a finished run's bank must be gone.

    python bench/record_signals.py [--prompts 24] [--prompt-len 200] [--json PATH]

Bounded: each run has a time limit (``--timeout``) and is killed with its
whole session past it.  Exit status: the number of runs that left something
or ended otherwise than expected.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTED = {"complete": (0, "wrote "), "sigterm": (128 + signal.SIGTERM, "stopped by signal 15; nothing written"),
            "sigint-group": (130, "interrupted; nothing written")}


def leftovers(out_dir: str, before: set[str]) -> list[str]:
    tmp = tempfile.gettempdir()
    found = {*glob.glob(os.path.join(tmp, "vllm_dist_*")), *glob.glob("/dev/shm/vllm_dist_*"),
             *glob.glob(os.path.join(tmp, "kvfill-record-*")),
             *glob.glob(os.path.join(tmp, "kvfill-parts-*"))} - before
    return sorted(found | set(glob.glob(os.path.join(out_dir, "kvfill-record-*"))))


def session_processes(sid: int) -> list[int]:
    out = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getsid(pid) == sid:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(")")[-1].split()[0] != "Z":
                        out.append(pid)
        except OSError:
            continue
    return out


def run(kind: str, a, model: str, prompts: str, out_dir: str) -> dict:
    out = os.path.join(out_dir, f"bank-{kind}.safetensors")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONUNBUFFERED": "1"}
    before = leftovers(out_dir, set())
    cmd = [sys.executable, "-m", "kvfill.record", "--model", model, "--prompts", prompts, "--out", out,
           "--tensor-parallel-size", "2", "--dtype", "float32", "--max-num-seqs", "2", "--enforce-eager"]
    t0 = time.monotonic()
    log_path = os.path.join(out_dir, f"{kind}.log")
    with open(log_path, "w") as log:
        # its own session: the SIGINT goes to its process group as a terminal's Ctrl-C does
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=ROOT)
    sent = None
    try:
        while proc.poll() is None and time.monotonic() - t0 < a.timeout:
            # the workers' parts, in folders of their own until the recorder fetches them
            saved = glob.glob(os.path.join(tempfile.gettempdir(), "kvfill-parts-*", "*.safetensors*"))
            if kind != "complete" and sent is None and saved:
                if kind == "sigterm":
                    proc.send_signal(signal.SIGTERM)
                else:
                    os.killpg(proc.pid, signal.SIGINT)
                sent = round(time.monotonic() - t0, 1)
            time.sleep(0.2)
        if proc.poll() is None:  # past the time limit: the whole session goes
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    time.sleep(1)
    left = leftovers(out_dir, set(before))
    procs = session_processes(proc.pid)
    with open(log_path) as f:
        lines = [line.rstrip() for line in f if line.startswith("kvfill-record") or line.startswith("wrote ")]
    last = lines[-1] if lines else ""
    want_rc, want_line = EXPECTED[kind]
    bank = os.path.exists(out)
    ok = (rc == want_rc and want_line in last and not left and not procs and bank == (kind == "complete")
          and (kind == "complete" or sent is not None))
    return {"run": kind, "rc": rc, "signal_sent_at_s": sent, "seconds": round(time.monotonic() - t0, 1),
            "last_line": last, "bank_written": bank, "left_behind": left, "processes_left": procs, "ok": ok}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--timeout", type=float, default=300, help="seconds per run before its session is killed")
    p.add_argument("--runs", nargs="+", default=list(EXPECTED), choices=list(EXPECTED))
    p.add_argument("--out-dir", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from kvfill.bench import models

    model = os.path.join(ROOT, "out", "tiny-llama")
    models.make_model(model)
    out_dir = a.out_dir or tempfile.mkdtemp(prefix="record-signals-")
    os.makedirs(out_dir, exist_ok=True)
    prompts = os.path.join(out_dir, "prompts.txt")
    with open(prompts, "w") as f:
        for i in range(a.prompts):
            f.write(" ".join(f"w{3 + (i * 7 + k) % 900}" for k in range(a.prompt_len)) + "\n")
    rows = [run(kind, a, model, prompts, out_dir) for kind in a.runs]
    for r in rows:
        print(f"{r['run']:13s} rc {r['rc']:4d}  signal at {str(r['signal_sent_at_s']):>5s} s  "
              f"{'bank' if r['bank_written'] else 'no bank'}  left {len(r['left_behind'])} files, "
              f"{len(r['processes_left'])} processes  {'OK' if r['ok'] else 'FAIL'}  | {r['last_line'][:70]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python bench/record_signals.py " + " ".join(argv if argv is not None
                                                                              else sys.argv[1:]),
                       "rows": rows}, f, indent=1)
    return sum(not r["ok"] for r in rows)


if __name__ == "__main__":
    sys.exit(main())
