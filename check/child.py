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
"""
from __future__ import annotations

import signal
import sys


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


def main(argv=None) -> int:
    for s in (signal.SIGTERM, signal.SIGHUP):  # first: the step's imports take seconds
        signal.signal(s, _exit_on)
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
