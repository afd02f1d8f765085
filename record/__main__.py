"""``python -m kvfill.record`` / ``kvfill-record``: record a bank (kvfill.record).

    kvfill-record --model MODEL --prompts FILE --out BANK [--positions CAP] [--budget-gib G] [vLLM engine flags]

Takes vLLM's own engine flags, parsed as ``vllm serve`` parses them
(``--tensor-parallel-size``, ``--dtype``, ``--max-model-len``,
``--trust-remote-code``, ``--quantization``, ``--config FILE.yaml`` ...), so a
serving run's flags record its model the same way; ``--help`` lists them
all.  Flags recording cannot honour (``--decode-context-parallel-size`` > 1,
``--enable-prefix-caching``, ``--kv-transfer-config`` ...: ``cli.REFUSED``)
are refused before vLLM starts.  Errors print as ``kvfill-record: error:
...`` and exit 2, with nothing written.
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    """Parse (``cli.record_call``), then record; a RecordError is the user's
    input, not a crash, so it prints one line instead of a traceback."""
    from kvfill.record import RecordError, record

    from .cli import record_call

    try:
        record(**record_call(argv))
    except RecordError as exc:
        print(f"kvfill-record: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (signals.stop_signals); vLLM stopped and the work folder removed
        print("kvfill-record: interrupted; nothing written", file=sys.stderr)
        return 130
    except SystemExit as exc:  # SIGTERM (signals.stop_signals), or argparse's own exit
        if isinstance(exc.code, int) and exc.code > 128:
            print(f"kvfill-record: stopped by signal {exc.code - 128}; nothing written", file=sys.stderr)
        raise
    return 0


if __name__ == "__main__":  # vLLM's workers are spawned and re-import the main module
    sys.exit(main())
