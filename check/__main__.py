"""``python -m kvfill.check`` / ``kvfill-check``: the validity report (kvfill.check).

    kvfill-check --model MODEL --prompts FILE [--bank BANK] [--out DIR] [check options] [vLLM engine flags]

Exit 0 with the report written (a failed run is in it), 1 when real prefill
itself failed (nothing to compare with), 2 on bad input (nothing run).
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    from .cli import CheckError, check_config

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = check_config(argv)
    except CheckError as exc:
        print(f"kvfill-check: error: {exc}", file=sys.stderr)
        return 2
    from .compare import compare_all
    from .inputs import prepare
    from .report import verdicts, write
    from .runner import run_all

    try:
        inputs = prepare(cfg)
    except ValueError as exc:  # CheckError, or kvfill-record's RecordError about the prompts file: nothing written
        print(f"kvfill-check: error: {exc}", file=sys.stderr)
        return 2
    try:
        res = run_all(cfg, inputs, log=lambda line: print(line, flush=True))
    except CheckError as exc:  # the host cannot hold the runs' KV space: raised before anything is written
        print(f"kvfill-check: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvfill-check: interrupted; the running step was stopped", file=sys.stderr)
        return 130
    cmp = compare_all(res)
    lines = verdicts(res, cmp)
    paths = write(cfg.out, cfg, res, cmp, lines)
    print("\n".join(["", *lines, "", "wrote " + ", ".join(paths)]), flush=True)
    return 1 if "reference_failed" in cmp else 0


if __name__ == "__main__":  # vLLM's workers are spawned and re-import the main module
    sys.exit(main())
