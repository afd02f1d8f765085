"""``python -m kvfill.check.child JOB RESULT``: one check step in a process
of its own (runner.py starts it): a recording (``kind: record``, kvfill's
``record()``) or a run (``measure.run``).  The job is a pickle the runner
wrote; the result is JSON.  A failure exits non-zero with the traceback in
the step's log, which the runner quotes in the report.
"""
from __future__ import annotations

import json
import pickle
import sys


def execute(job: dict) -> dict:
    """The step ``job`` describes; its result (here, or in-process with ``--in-process``)."""
    if job["kind"] == "record":
        from kvfill.record import record

        record(**job["call"], log=lambda line: print(line, flush=True))
        return {"bank": job["call"]["out"]}
    from .measure import run

    return run(job)


def main(argv=None) -> int:
    job_file, result_file = sys.argv[1:3] if argv is None else argv
    with open(job_file, "rb") as f:
        job = pickle.load(f)
    result = execute(job)
    with open(result_file, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # vLLM's workers are spawned and re-import the main module
    sys.exit(main())
