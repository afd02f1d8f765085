"""How fast a two-node recording fails on every node when one node stops or
never starts (``kvfill/record/liveness.py``), measured on loopback with
vLLM's CPU engine: each node its own kvfill-record process (``--nnodes 2``,
TP 2: one worker per node), the tiny Llama, one node stopped the moment the
first node's worker starts recording (``TRIGGER`` in its log).

    python bench/node_failures.py                     # every scenario, --node-wait 30
    python bench/node_failures.py --scenarios further-killed first-never --json out/node-failures.json

Scenarios (the node stopped or missing, how; the other node's exit timed):

- ``further-killed`` / ``further-stopped``: node 1's process group gets
  SIGKILL (a crash, a machine gone: its beat stalls) / SIGTERM (it says so);
  node 0's exit is timed from the signal.
- ``first-killed`` / ``first-stopped``: the same to node 0; node 1's exit.
- ``first-never``: node 0 refused at its own input checks (``--out`` in a
  missing folder); node 1's exit is timed from node 0's.
- ``further-never``: node 1 never started; node 0's exit is timed from its
  start (its wait: ``--node-wait`` from its engine's start).

Every process is started in its own session and killed by process group at
the end, whatever happened; every wait is bounded (``--limit``).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from kvfill.bench.common import cpu_features, table, write_json
from kvfill.bench.serve import free_port

LEFTOVERS = ("vllm_dist_*", "kvfill-record-*", "kvfill-parts-*")  # what a node's run must not leave in its temp folder
TRIGGER = "KVFillConnector: recording each prompt's positions"  # node 0's worker is up: node 1 has joined
SCENARIOS = ("further-killed", "further-stopped", "first-killed", "first-stopped", "first-never", "further-never")


def start_node(rank: int, model: str, prompts: str, port: int, out: str, log_path: str, node_wait: float,
               tmpdir: str, extra=(), node_silence: float | None = None) -> subprocess.Popen:
    """One node's ``kvfill-record`` (TP 2 over 2 nodes, eager, float32),
    its output into ``log_path``, in a session of its own, with a temp
    folder of its own (``tmpdir``: its machine's disk)."""
    flags = ["--model", model, "--prompts", prompts, "--dtype", "float32", "--tensor-parallel-size", "2",
             "--enforce-eager", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--out", out, "--node-rank", str(rank), "--node-wait", f"{node_wait:g}",
             *(["--node-silence", f"{node_silence:g}"] if node_silence is not None else []), *extra]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(rank), "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_TARGET_DEVICE": "cpu", "TMPDIR": tmpdir,
           "VLLM_RPC_BASE_PATH": tmpdir}  # vLLM's ZMQ sockets: short paths (at most 107 characters)
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "kvfill.record", *flags], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(log_path: str, text: str, proc: subprocess.Popen, limit: float) -> bool:
    start = time.monotonic()
    while time.monotonic() - start < limit and proc.poll() is None:
        with open(log_path, errors="replace") as f:
            if text in f.read():
                return True
        time.sleep(0.1)
    return False


def _exits(procs: dict, since: float, limit: float) -> dict:
    """Each process's exit, in seconds after ``since`` (None: still running
    ``limit`` seconds after it), polled every 50 ms."""
    found = {r: None for r in procs}
    while time.monotonic() - since < limit and any(v is None for v in found.values()):
        for r, proc in procs.items():
            if found[r] is None and proc.poll() is not None:
                found[r] = round(time.monotonic() - since, 1)
        time.sleep(0.05)
    return found


def _error_line(log_path: str) -> str:
    with open(log_path, errors="replace") as f:
        lines = [line.strip() for line in f if line.startswith("kvfill-record: error:")]
    return lines[-1] if lines else ""


def _stop(procs) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def scenario(name: str, model: str, prompts: str, work: str, node_wait: float = 30.0, limit: float = 120.0,
             node_silence: float | None = None) -> dict:
    """One scenario (module docstring): the surviving node's exit code,
    seconds to exit (None: still running after ``limit``), error line and
    what it left in its temp folder (``left``: vLLM's rendezvous and
    kvfill's work and parts folders).  The stopped node's temp folder (its
    machine's disk) is removed whatever it holds: a killed process leaves its
    files."""
    if name not in SCENARIOS:
        raise ValueError(f"scenario {name!r}: expected one of {', '.join(SCENARIOS)}")
    port, logs = free_port(), {r: os.path.join(work, f"{name}-node{r}.log") for r in (0, 1)}
    bank = os.path.join(work, f"{name}.safetensors")
    stopped, survivor = (1, 0) if name.startswith("further") else (0, 1)
    procs: dict[int, subprocess.Popen | None] = {0: None, 1: None}
    # short paths: vLLM's ZMQ sockets live in the temp folder, at most 107 characters
    tmp = {r: tempfile.mkdtemp(prefix=f"node{r}-") for r in (0, 1)}
    row = {"scenario": name, "survivor": f"node {survivor}", "triggered": True}
    try:
        if name != "further-never":
            procs[1] = start_node(1, model, prompts, port, os.path.join(work, "n1"), logs[1], node_wait, tmp[1],
                                  node_silence=node_silence)
        out = os.path.join(work, "missing", "bank.safetensors") if name == "first-never" else bank
        procs[0] = start_node(0, model, prompts, port, out, logs[0], node_wait, tmp[0], node_silence=node_silence)
        since = time.monotonic()
        if name == "first-never":
            procs[0].wait(timeout=limit)
            since = time.monotonic()
        elif not name.endswith("-never"):
            row["triggered"] = _wait_for(logs[0], TRIGGER, procs[0], limit)
            os.killpg(procs[stopped].pid, signal.SIGKILL if name.endswith("killed") else signal.SIGTERM)
            since = time.monotonic()
        running = {r: proc for r, proc in procs.items() if proc is not None}
        row["seconds"] = _exits(running, since, limit)[survivor]
        row["rc"] = procs[survivor].poll()
        row["error"] = _error_line(logs[survivor])
    finally:
        _stop(procs.values())
        row["left"] = sorted(os.path.relpath(p, tmp[survivor]) for name in LEFTOVERS
                             for p in glob.glob(os.path.join(tmp[survivor], "**", name), recursive=True))
        for folder in tmp.values():
            shutil.rmtree(folder, ignore_errors=True)
    row["bank_written"] = os.path.exists(bank)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--node-wait", type=float, default=30.0, help="kvfill-record --node-wait (default 30)")
    p.add_argument("--limit", type=float, default=180.0, help="the most seconds any wait takes (default 180)")
    p.add_argument("--prompts", type=int, default=60, help="prompts of 150 tokens (node 0 prefills while stopped)")
    p.add_argument("--out-dir", default=None, help="work folder (default out/node-failures)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    from kvfill.bench.models import PEAKED_STD, make_model, make_tokenizer, word_prompts, write_lines

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "out")
    work = os.path.abspath(a.out_dir or os.path.join(root, "node-failures"))
    os.makedirs(work, exist_ok=True)
    model = make_tokenizer(make_model(os.path.abspath(os.path.join(root, "tiny-llama-peaked")), init_std=PEAKED_STD))
    prompts = os.path.join(work, "prompts.txt")
    write_lines(prompts, word_prompts([150] * a.prompts, seed=3))
    rows = []
    for name in a.scenarios:
        row = scenario(name, model, prompts, work, a.node_wait, a.limit)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\ntwo-node recording on loopback (TP 2, one worker per node, tiny Llama, {a.prompts} prompts x 150 "
          f"tokens), --node-wait {a.node_wait:g}: seconds from the stop (or, -never, from the survivor's own "
          f"start or the other's exit) to the surviving node's exit")
    print(table(rows, ["scenario", "survivor", "seconds", "rc", "left", "error"]))
    ok = all(r["seconds"] is not None and r["rc"] == 2 and r["triggered"] and not r["bank_written"] and not r["left"]
             for r in rows)
    if a.json:
        write_json(a.json, {"args": vars(a), "machine": cpu_features(), "rows": rows})
    print("every surviving node failed within the bound, naming the node" if ok else "CLAIM NOT MET")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
