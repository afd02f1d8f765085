"""``python -m kvfill.check`` / ``kvfill-check``: the validity report (kvfill.check).

    kvfill-check --model MODEL --prompts FILE [--bank BANK] [--out DIR] [check options] [vLLM engine flags]

Exit 0 with the report written (a failed run is in it), 1 when real prefill
itself failed (nothing to compare with), 2 on bad input (nothing run; also
while another check holds ``--out``), and 128 + the signal's number when
SIGTERM (143), SIGHUP (129) or SIGINT (130) stopped it: the running step and
its engine stopped, and once real prefill was measured a report of what was,
marked partial.
"""
from __future__ import annotations

import contextlib
import os
import sys


def main(argv=None) -> int:
    from .env_checks import given_kv_space

    try:
        given_kv_space()  # before vLLM's import: seconds to a minute
    except ValueError as exc:
        print(f"kvfill-check: error: {exc}", file=sys.stderr)
        return 2
    from .cli import CheckError, check_config

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = check_config(argv)
    except CheckError as exc:
        print(f"kvfill-check: error: {exc}", file=sys.stderr)
        return 2
    from .inputs import prepare
    from .report import holding
    from .runner import run_all
    from .steps import Stopped, stop_on_signals

    with stop_on_signals(), contextlib.ExitStack() as held:
        try:
            try:
                inputs = prepare(cfg)
                held.enter_context(holding(cfg.out))  # CheckError while another check writes there
            except ValueError as exc:  # CheckError, or kvfill-record's RecordError about the prompts file: nothing
                print(f"kvfill-check: error: {exc}", file=sys.stderr)  # written
                return 2
            try:
                res = run_all(cfg, inputs, log=lambda line: print(line, flush=True))
            except CheckError as exc:  # the host cannot hold the runs' KV space: raised before anything is written
                print(f"kvfill-check: error: {exc}", file=sys.stderr)
                return 2
            cmp, lines, paths = _report(cfg, res)
        except Stopped as stop:
            logs = os.path.join(cfg.out, "logs")
            where = f"; the steps' logs are in {logs}" if os.path.isdir(logs) else ""
            ctrl_c = " (Ctrl-C)" if stop.name == "SIGINT" else ""
            partial = getattr(stop, "partial", None)
            # a further signal is noted, not raised, while stop_on_signals holds: the partial report is written whole
            if partial and "error" not in partial["steps"].get("prefill", {"error": "not run"}):
                wrote = "a partial report of what was measured: " + ", ".join(_report(cfg, partial)[2])
            else:
                wrote = "no report written (real prefill was not measured: nothing to compare)"
            _say(f"kvfill-check: stopped by {stop.name}{ctrl_c}: the running step and its engine were stopped, "
                 f"nothing of the check is left running; {wrote}{where}")
            return stop.exit_code
    warned = [f"vLLM warned (bears on timing): {w['warning']}" for w in res.get("timing_warnings", [])]
    print("\n".join(["", *lines, *warned, "", "wrote " + ", ".join(paths)]), flush=True)
    return 1 if "reference_failed" in cmp else 0


def _report(cfg, res: dict) -> tuple[dict, list[str], list[str]]:
    """The comparison, the verdict lines and the report's paths (written)."""
    from .compare import compare_all
    from .report import write
    from .verdict import verdicts

    cmp = compare_all(res)
    lines = verdicts(res, cmp)
    return cmp, lines, write(cfg.out, cfg, res, cmp, lines)


def _say(line: str) -> None:
    """One line on stderr, if there is still somewhere to write it (SIGHUP: the terminal may be gone)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


if __name__ == "__main__":  # vLLM's workers are spawned and re-import the main module
    sys.exit(main())
