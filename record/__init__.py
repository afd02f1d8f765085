"""kvfill.record: record real KV once, for replay fills.

    python -m kvfill.record --model MODEL --prompts FILE --out BANK [--positions CAP] [--budget-gib G]
                            [vLLM engine flags: --tensor-parallel-size T, --dtype, ... (cli.py)]
    kvfill-record ...                        (the same, installed as a console script)

The package's face: ``record()``, ``RecordError`` and the input checks, each
from the file that holds it.

* ``recording.py``: ``record()``, the whole recording from prompts file to
  bank file, and its work folder (how it works: its docstring).
* ``inputs.py``: every input checked before vLLM starts, and the size
  estimate.
* ``cli.py``: kvfill-record's command line (vLLM's engine flags parsed as
  ``vllm serve`` does); ``__main__.py``: its entry point.
* ``run.py``: the recorder's vLLM run (``run_vllm``), with the hybrid state
  tail.
* ``engine_config.py``: the engine flags, their digest, vLLM's refusals and
  failures put in one line.
* ``engine.py``: the vLLM engine's life cycle (``llm_engine``) and the files
  it leaves.
* ``transfer.py``: the workers' parts fetched through vLLM's RPC.
* ``nodes.py``: a recording on several nodes.
* ``signals.py``: SIGTERM and SIGINT stop a recording.
* ``assemble.py``: the workers' rows merged into one canonical bank.
"""
from __future__ import annotations

from .assemble import assemble, rows_path
from .inputs import (
    Estimate, RecordError, check_budget, check_max_model_len, check_out, check_prompt_lengths, choose_positions,
    default_max_model_len, estimate, read_prompt_lines, read_prompts, unresolved, with_drafter,
)
from .nodes import host_workers
from .recording import record
from .run import without_tail
from .signals import stop_signals

__all__ = [
    "Estimate", "RecordError", "assemble", "check_budget", "check_max_model_len", "check_out", "check_prompt_lengths",
    "choose_positions", "default_max_model_len", "estimate", "host_workers", "read_prompt_lines", "read_prompts",
    "record", "rows_path", "stop_signals", "unresolved", "with_drafter", "without_tail",
]
