"""``python -m kvfill.check.child JOB RESULT``: one check step in a process
of its own (runner.py starts it): a recording (``kind: record``, kvfill's
``record()``) or a run (``measure.run``).  The job is a pickle the runner
wrote; the result is JSON.  A failure exits non-zero with the traceback in
the step's log, which the runner quotes in the report.

SIGTERM (the runner's stop: ``--run-timeout``, or the check itself
stopped) and SIGHUP end the step as an exception, ``SystemExit(128 +
signum)``, so its engine is shut down and its temp folders removed on the
way out (``record.engine.llm_engine``); a second one is ignored, so it
does not cut that short.

A check killed outright (SIGKILL, the OOM killer) cannot stop its step:
the step asks Linux for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``,
``die_with_parent``), ends as above, and removes the temp folder its
parent made for it (``KVFILL_STEP_TMP``), which no one else is left to -
with the standard library alone (``remove_temp_folder``): the signal may
land while the step still imports torch or vLLM, and importing anything
of theirs again on the way out re-enters that half-done import.
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import sys

PARENT_ENV, TMP_ENV = "KVFILL_CHECK_PID", "KVFILL_STEP_TMP"  # set by steps.py for each step it starts
SHM = "/dev/shm"  # vLLM CPU's shared-memory segments, named after the rendezvous file's id


def execute(job: dict) -> dict:
    """The step ``job`` describes; its result (here, or in-process with ``--in-process``)."""
    if job["kind"] == "record":
        from kvfill.record import record

        record(**job["call"], log=lambda line: print(line, flush=True))
        return {"bank": job["call"]["out"]}
    from .measure import run

    return run(job)


def _exit_on(signum, frame):
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda *_: None)  # the first one stops the step; the way out runs whole
    print(f"kvfill.check.child: {signal.Signals(signum).name}: stopping the step", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def die_with_parent(parent: int | None = None) -> bool:
    """SIGTERM to this process when the check that started it (``parent``,
    else ``KVFILL_CHECK_PID``) dies (Linux's ``PR_SET_PDEATHSIG``), and at
    once if it died already; True when set."""
    parent = parent or int(os.environ.get(PARENT_ENV) or 0)
    if not parent or not sys.platform.startswith("linux"):
        return False
    import ctypes

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the check died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def dying_with_this_process(cmd: list[str]) -> list[str]:
    """``cmd`` run so that it gets SIGTERM when this process dies: a
    Python that asks Linux for it, then becomes ``cmd`` (``exec``; the
    request survives it).  For the commands the check starts other than
    its steps (``vllm serve``, ``vllm bench serve``); a Popen
    ``preexec_fn`` would do the same, but is unsafe in a process with
    threads (vLLM's, with ``--in-process``)."""
    code = ("import os, sys; from kvfill.check.child import die_with_parent; "
            "die_with_parent(int(sys.argv[1])); os.execvp(sys.argv[2], sys.argv[2:])")
    return [sys.executable, "-c", code, str(os.getpid()), *cmd]


def guard(grace_s: float = 30.0) -> None:
    """What ``serving.Guard`` starts beside a server: a process of its own
    session that outlives the check, told on its stdin, one line each,
    ``group PID`` / ``folder PATH`` to watch and ``ungroup PID`` /
    ``unfolder PATH`` to let go.  Its stdin's end is the check's end: if
    the check did not say ``done`` first (it was killed outright, and its
    own ``finally`` never ran), each watched process group gets SIGTERM,
    SIGKILL ``grace_s`` later, and each watched folder is removed with its
    shared memory (``remove_temp_folder``)."""
    import time

    groups, folders = set(), set()
    for line in sys.stdin:
        verb, _, what = line.rstrip("\n").partition(" ")
        if verb == "done":
            return
        watched = groups if verb.endswith("group") else folders
        item = int(what) if watched is groups else what
        (watched.discard if verb.startswith("un") else watched.add)(item)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for group in list(groups):
            try:
                os.killpg(group, sig)
            except ProcessLookupError:
                groups.discard(group)
        deadline = time.monotonic() + wait
        while groups and time.monotonic() < deadline:
            time.sleep(0.2)
            groups = {g for g in groups if _group_alive(g)}
    for folder in folders:
        remove_temp_folder(folder)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _orphaned() -> bool:
    parent = int(os.environ.get(PARENT_ENV) or 0)
    return bool(parent) and os.getppid() != parent


def main(argv=None) -> int:
    for s in (signal.SIGTERM, signal.SIGHUP):  # first: the step's imports take seconds
        signal.signal(s, _exit_on)
    die_with_parent()
    try:
        return _run(argv)
    finally:
        tmp = os.environ.get(TMP_ENV)
        if tmp and _orphaned():  # the check was killed: its step's temp folder is this process's to remove
            remove_temp_folder(tmp)


def remove_temp_folder(folder: str) -> None:
    """A step's or server's temp folder (its ``TMPDIR``), with the
    shared-memory segments of each vLLM rendezvous file in it, at any depth
    (an engine's own temp folder is inside).  Imports nothing: the way out
    of a step stopped mid-import calls it (module docstring)."""
    ids = {os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(folder), "**", "vllm_dist_*"),
                                                  recursive=True)}
    for ident in ids:
        for path in glob.glob(os.path.join(SHM, glob.escape(ident) + "-*")):
            with contextlib.suppress(OSError):
                os.unlink(path)
    shutil.rmtree(folder, ignore_errors=True)


def _run(argv) -> int:
    import json
    import pickle

    job_file, result_file = sys.argv[1:3] if argv is None else argv
    with open(job_file, "rb") as f:
        job = pickle.load(f)
    result = execute(job)
    with open(result_file, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # vLLM's workers are spawned and re-import the main module
    sys.exit(main())
