"""kvfill-check's steps: each in a process of its own (``kvfill.check.child``),
bounded by ``--run-timeout`` (or in this one, ``--in-process``), with a temp
folder of its own removed however it ended; and the check's stop on a
signal: SIGTERM, SIGHUP and SIGINT (``stop_on_signals``: ``Stopped``) stop
the running step's process group (or, in-process, its engine); and a
run's progress, its timed passes counted from its log (``PassProgress``).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import classes
from .child import PARENT_ENV, TMP_ENV, remove_temp_folder
from .cli import CheckConfig, on_cpu
from .probes import PASS_DONE

HEARTBEAT_S = 30
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Stopped(BaseException):
    """A signal stopped the check (``stop_on_signals``): SIGTERM (``kill``,
    ``timeout``, job schedulers), SIGHUP (the terminal went away) or SIGINT
    (Ctrl-C).  Not an Exception: no step's error handling takes it for the
    step's own failure."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's code for a process a signal ended: 143, 129, 130


_stopped_by: list[int] = []  # the signal stop_on_signals caught, while it holds


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM, SIGHUP and SIGINT raise ``Stopped`` in the main thread while
    the block runs, so every step's ``finally`` runs: a child step's process
    group is stopped (``step``), an in-process engine shut down.  A further
    signal while stopping is noted, not raised, so the stop is not cut
    short (a child's group gets SIGKILL 15 s after SIGTERM anyway).  A step
    that turned the signal into an error of its own (in-process, vLLM's
    workers got it too) is reported as the signal (``_raise_if_stopped``).
    Outside the main thread (no handler can be set there) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}

    def stop(signum, frame):
        if not _stopped_by:
            _stopped_by.append(signum)
            raise Stopped(signum)

    for s in STOP_SIGNALS:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        _stopped_by.clear()


def _raise_if_stopped(cause: BaseException | None = None) -> None:
    if _stopped_by:
        raise Stopped(_stopped_by[0]) from cause


def child_env(cfg: CheckConfig) -> dict:
    """On vLLM CPU with several workers (TP x PP) and no ``VLLM_CPU_OMP_THREADS_BIND``:
    this process's cores split evenly between them (``worker_cores``)."""
    workers = int(cfg.engine.get("tensor_parallel_size") or 1) * int(cfg.engine.get("pipeline_parallel_size") or 1)
    return worker_cores(workers) if on_cpu() else {}


def worker_cores(workers: int) -> dict:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``workers`` vLLM CPU workers
    an even share of this process's cores, unless the user set it.  vLLM's
    own binding ("auto") gives each worker a NUMA node and refuses more
    workers than nodes."""
    if workers < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < workers:
        return {}  # vLLM says why it cannot bind
    per = len(cores) // workers
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cores[w * per:(w + 1) * per]))
                                                  for w in range(workers))}


def step(name: str, job: dict, cfg: CheckConfig, i: int, n: int, log, env: dict | None = None) -> dict:
    """One step in a child process, bounded by ``--run-timeout`` (or in this
    one, ``--in-process``); its result, or ``{"error": ...}`` naming how it
    failed and its log.  ``env``: the step's environment beside this
    process's and ``child_env`` (``kv_env``).  The child's temp folder
    (``TMPDIR``: vLLM's rendezvous files, the recorder's and its workers'
    folders) is one of the step's own, removed with what it names in
    /dev/shm however the step ended - a child killed (SIGKILL) cleans
    nothing up itself; so is a recording's work folder beside its bank
    when the step was stopped or killed."""
    if cfg.in_process:
        return _in_process(name, job, cfg, i, n, log, env)
    logs = os.path.join(cfg.out, "logs")
    job_file, result_file, log_file = (os.path.join(logs, f"{name}.{ext}") for ext in ("job", "json", "log"))
    with open(job_file, "wb") as f:
        pickle.dump(job, f)
    if os.path.exists(result_file):
        os.unlink(result_file)
    tmp = tempfile.mkdtemp(prefix=f"kvfill-step-{name}-")
    work = _record_work(job)
    before = set(glob.glob(work)) if work else set()
    env = {**os.environ, **child_env(cfg), **(env or {}), "TMPDIR": tmp,
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the hooks live in this process
           PARENT_ENV: str(os.getpid()), TMP_ENV: tmp}  # the step dies with the check (child.die_with_parent)
    log(f"[{i}/{n}] {name}: starting (log {log_file})")
    t0 = time.perf_counter()
    rc = None
    try:
        with open(log_file, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "kvfill.check.child", job_file, result_file], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = _wait(proc, name, cfg, log, PassProgress(log_file, pass_plan(job)))
            finally:
                _stop(proc)  # what of its group is left, also after the child's own exit
    finally:
        remove_temp_folder(tmp)
        if work and (rc is None or rc < 0):  # stopped or killed: the recorder could not remove it
            for folder in set(glob.glob(work)) - before:
                shutil.rmtree(folder, ignore_errors=True)
    took = round(time.perf_counter() - t0, 1)
    os.unlink(job_file)
    if rc == 0 and os.path.exists(result_file):
        with open(result_file) as f:
            result = json.load(f)
        log(f"[{i}/{n}] {name}: done in {took:.0f} s")
        return {**result, "step_s": took}
    why = f"stopped after --run-timeout {cfg.run_timeout:g} s" if rc is None else f"exit {rc}"
    error = f"{why}: {_last_error(log_file)} (log {log_file})"
    log(f"[{i}/{n}] {name}: FAILED, {error}")
    return {"run": name, "error": error, "step_s": took}


def _record_work(job: dict) -> str | None:
    """A recording step's work folders, as a glob: ``kvfill-record-*``
    beside its bank (kvfill-record's ``_work_dir``); None for a run."""
    if job.get("kind") != "record":
        return None
    return os.path.join(glob.escape(os.path.dirname(os.path.abspath(job["call"]["out"]))), "kvfill-record-*")


def _in_process(name: str, job: dict, cfg: CheckConfig, i: int, n: int, log, env: dict | None = None) -> dict:
    """The step here, its exception reported as a child's failure is; the raw
    result in logs/NAME.json.  A signal that stopped the check while the
    step ran is raised as such (``Stopped``), whatever the step made of it."""
    import gc
    import traceback

    from .child import execute

    env = {**child_env(cfg), **(env or {}), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    log(f"[{i}/{n}] {name}: starting (in this process)")
    t0 = time.perf_counter()
    try:
        result = execute(job)
    except Exception as exc:
        _raise_if_stopped(exc)
        traceback.print_exc()
        error = f"{type(exc).__name__}: {str(exc)[:400]}"
        log(f"[{i}/{n}] {name}: FAILED, {error}")
        return {"run": name, "error": error, "step_s": round(time.perf_counter() - t0, 1)}
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        gc.collect()  # the engine's memory before the next one's
    _raise_if_stopped()
    took = round(time.perf_counter() - t0, 1)
    with open(os.path.join(cfg.out, "logs", f"{name}.json"), "w") as f:
        json.dump(result, f)
    log(f"[{i}/{n}] {name}: done in {took:.0f} s")
    return {**result, "step_s": took}


def _wait(proc: subprocess.Popen, name: str, cfg: CheckConfig, log, progress: "PassProgress | None" = None
          ) -> int | None:
    """The child's exit status, or None when it ran past ``cfg.run_timeout``
    (read at each look: a caller may shorten it) and was stopped.  Every
    ``HEARTBEAT_S`` a line: how long it has run, and ``progress``'s passes."""
    t0 = time.perf_counter()
    next_beat = HEARTBEAT_S
    while proc.poll() is None:
        elapsed = time.perf_counter() - t0
        if elapsed > cfg.run_timeout:
            _stop(proc)
            return None
        if elapsed >= next_beat:
            log(f"      {name}: running, {elapsed:.0f} s" + (progress.line() if progress else ""))
            next_beat += HEARTBEAT_S
        time.sleep(0.5)
    return proc.returncode


def pass_plan(job: dict) -> list[tuple[float, bool]]:
    """The passes a run's step makes (``measure.time_passes``), in order,
    each as (its share of the prompts, whether it is untimed): 2 untimed
    and 2N timed over every prompt, then as many over each class's prompts
    (``classes`` in the job: --time-by-class on); [] for a step that times
    none."""
    n = job.get("time_passes") or 0
    if job.get("kind") != "run" or job.get("run") == "prefill_split" or not n:
        return []
    shares = [1.0] + [len(idx) / len(job["ids"]) for idx in classes.groups(job.get("classes")).values()]
    return [(share, i < 2) for share in shares for i in range(2 * n + 2)]


class PassProgress:
    """A step's passes as its log tells them (``probes.PASS_DONE`` lines)
    against its ``pass_plan``: how many are done and about how long the rest
    take - seconds per share of the prompts, from the timed passes done
    (the untimed first ones run slower: only while no timed one is done)."""

    def __init__(self, log_file: str, plan: list[tuple[float, bool]]):
        self.log_file, self.plan, self.offset, self.took = log_file, plan, 0, []

    def _read(self) -> None:
        with open(self.log_file, "rb") as f:
            f.seek(self.offset)
            text = f.read()
        text = text[:text.rfind(b"\n") + 1]  # whole lines only: the rest is read at the next look
        self.offset += len(text)
        for line in text.decode(errors="replace").splitlines():
            if line.startswith(PASS_DONE):
                self.took.append(float(line[len(PASS_DONE):].split()[0]))

    def line(self) -> str:
        """"; passes 5/24 done, about 7 min of them left" (empty for a step that makes none)."""
        if not self.plan:
            return ""
        self._read()
        done, total = min(len(self.took), len(self.plan)), len(self.plan)
        if not done:
            return f"; passes 0/{total} done (they follow the greedy run)"
        seen = [i for i in range(done) if not self.plan[i][1]] or list(range(done))
        per_share = sum(self.took[i] for i in seen) / sum(self.plan[i][0] for i in seen)
        left = per_share * sum(share for share, _ in self.plan[done:])
        return f"; passes {done}/{total} done, about {duration(left)} of them left"


def duration(seconds: float) -> str:
    """Seconds as a progress line says them: "90 s", "7 min"."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _stop(proc: subprocess.Popen) -> None:
    """The step's process group (its leader ``proc``): SIGTERM, then SIGKILL
    to what is left after 15 s; returns once the group is gone (or 5 s after
    SIGKILL).  Also after the leader's own exit: its workers may outlive it."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            proc.poll()  # the leader reaped, if it exited
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _last_error(log_file: str) -> str:
    """The log's last line naming an error, else its last line."""
    with open(log_file, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return (errors or lines or ["no output"])[-1][:400]
