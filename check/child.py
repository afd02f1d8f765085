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


def die_with_parent() -> bool:
    """SIGTERM to this process when the check that started it dies (Linux's
    ``PR_SET_PDEATHSIG``), and at once if it died already; True when set."""
    parent = int(os.environ.get(PARENT_ENV) or 0)
    if not parent or not sys.platform.startswith("linux"):
        return False
    import ctypes

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the check died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
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
