"""Record real KV once, for replay fills: ``record()`` (``kvfill.record``).

Runs vLLM's engine with real prefill over the prompts (FILE: UTF-8 text, one
prompt per line) with ``KVFillConnector`` in its record role: after the
forward that completes a prompt, the worker reads every attention layer's
rows of its positions from the request's own blocks (``wait_for_save``) and
saves them.  Every prompt is recorded whole (``--positions`` caps the length),
so each replays exactly as recorded whatever its length.  The rows are
assembled into one bank file (``kvfill.bank``: safetensors, per layer
the sequences' rows one after another (a ragged bank) in the cache's storage
dtype and the canonical K/V order of every layout, provenance in the
metadata).  Replay it with ``kv_connector_extra_config: {"fill_mode": "replay",
"bank": BANK}``.

Every input (``--out``'s folder, the prompts file, the budget, the prompts'
lengths against ``--positions`` and ``--max-model-len``) is checked before
vLLM starts: a RecordError names the value, and nothing is written.  The rows
are recorded into a work folder beside ``--out`` (``kvfill-record-*``),
removed at the end, on an error, on Ctrl-C and on SIGTERM (``signals.py``) -
after vLLM's engine and workers have stopped, with the files vLLM's CPU
backend leaves (``engine.py``); only when the bank cannot be written at the
end is it kept, and the error says where.

The size is estimated from the model's config before vLLM starts (positions
recorded in all x layers x row bytes of all the model's KV heads) and checked
against ``--budget-gib``; the bank actually written is checked again.

Under tensor and pipeline parallelism each worker saves its part (its KV
heads, its stage's layers) on its own node, the recorder fetches the parts
through vLLM's channel to its workers (``transfer.fetch_parts``: no
filesystem shared by the nodes) and merges them into one canonical bank
(``assemble.py``), the same as a TP 1 recording's: it replays at any TP, PP
and DCP size, each rank loading only its part.  Decode context parallelism is
not recorded under: record at the same TP size with DCP 1.

On several nodes with vLLM's multiprocessing executor, every node runs the
same command with vLLM's ``--nnodes N --master-addr A --master-port P`` and
its own ``--node-rank``: node 0 records and writes the bank, each other node
only hosts its workers (``nodes.host_workers``) until node 0 ends the
recording; node 0 refuses at start a node whose engine flags differ
(``engine_config.engine_digest``, checked through the connector's handshake).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import tempfile

from kvfill.bank import Bank, sequence_key
from kvfill.connector.drafter import drafter_identity

from .assemble import assemble
from .inputs import (
    RecordError, check_budget, check_max_model_len, check_nodes, check_out, check_prompt_lengths, choose_positions,
    default_max_model_len, estimate, read_prompt_lines, unresolved, with_drafter,
)
from .liveness import NODE_SILENCE_S, NODE_WAIT_S
from .nodes import host_workers
from .run import run_vllm as _run_vllm  # _run_vllm: tests stand in for it (patch it here)
from .run import without_tail
from .signals import stop_signals


class _WriteFailed(RecordError):
    """The recorded bank could not be written to ``--out``: the work folder is
    kept (recording again costs a whole vLLM run) and the message names it."""


def record(
    model: str,
    prompts_file: str,
    out: str,
    *,
    positions: int | None = None,
    budget_gib: float | None = None,
    dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    block_size: int | None = None,
    tokenizer: str | None = None,
    max_model_len: int | None = None,
    llm_kwargs: dict | None = None,
    node_wait: float = NODE_WAIT_S,
    log=print,
    node_silence: float = NODE_SILENCE_S,
) -> Bank | None:
    """Record the bank (module docstring); returns it after writing ``out``
    (None on a node other than the first, which writes nothing)."""
    from transformers import AutoTokenizer

    check_budget(budget_gib)
    check_out(out)
    check_max_model_len(max_model_len, positions)
    check_nodes(llm_kwargs or {}, node_wait, node_silence)
    lines = read_prompt_lines(prompts_file)
    line_numbers = [no for no, _ in lines]
    # vLLM's --trust-remote-code holds for the recorder's own reads of the model folder too
    trust = bool((llm_kwargs or {}).get("trust_remote_code", False))
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer or model, trust_remote_code=trust)
    except Exception as exc:  # OSError, the hub's errors, a config transformers cannot read
        raise RecordError(unresolved(exc, model=model, tokenizer=tokenizer)) from None
    ids = [list(tok(p).input_ids) for _, p in lines]
    lengths = choose_positions(ids, positions)
    recorded = [t[:n] for t, n in zip(ids, lengths)]  # what vLLM is sent
    check_prompt_lengths(recorded, line_numbers, max_model_len)
    run_max_len = max_model_len or default_max_model_len(recorded, line_numbers,
                                                         (llm_kwargs or {}).get("max_num_batched_tokens"))
    unique, seen = [], set()
    for t in recorded:
        key = sequence_key(t)
        if key not in seen:
            seen.add(key)
            unique.append(t)
    if len(unique) < len(ids):
        log(f"{len(ids) - len(unique)} prompt(s) repeat an earlier prompt's recorded tokens: recorded once")
    try:
        est = estimate(model, len(unique), sum(len(t) for t in unique), dtype, kv_cache_dtype,
                       trust_remote_code=trust)
    except Exception as exc:  # no config.json, or a config transformers cannot read
        raise RecordError(unresolved(exc, model=model, tokenizer=None)) from None
    spec = _spec_dict(llm_kwargs or {})
    if spec:
        try:
            est = with_drafter(est, model, spec, dtype, kv_cache_dtype, trust_remote_code=trust)
        except Exception as exc:  # a drafter config transformers cannot read: vLLM says more when it loads it
            log(f"the drafter's KV layers are not in the estimate ({type(exc).__name__}: {str(exc)[:200]})")
    log(f"bank estimate: {est}")
    budget = None if budget_gib is None else int(budget_gib * 2**30)
    if budget is not None and est.nbytes > budget:
        raise RecordError(f"the bank would take ~{est.nbytes / 2**30:.3f} GiB, over --budget-gib {budget_gib}; "
                          f"record fewer prompts or --positions")
    node = int((llm_kwargs or {}).get("node_rank") or 0)
    if node > 0:  # a further node: its workers join the first node's recording; the bank is written there
        with stop_signals():
            host_workers(model, unique, dtype, kv_cache_dtype, block_size, run_max_len, llm_kwargs or {},
                         tokenizer or model, log=log, node_wait=node_wait, node_silence=node_silence)
        return None
    with open(prompts_file, "rb") as f:  # the prompts recorded, not the file as it is after the run
        prompts_sha = hashlib.sha256(f.read()).hexdigest()

    with stop_signals(), _work_dir(out) as work:
        engine = _run_vllm(model, unique, work, dtype, kv_cache_dtype, block_size, run_max_len,
                           llm_kwargs or {}, tokenizer or model, _state_estimate(est, budget, budget_gib, log),
                           node_wait, log, node_silence)
        tail = int(engine.get("state_tail") or 0)
        if tail:  # a model with recurrent state: each prompt recorded without the tokens vLLM computes itself
            unique = without_tail(unique, tail)
            log(f"recurrent state recorded after all but the last {tail} token(s) of each prompt "
                f"({len(unique)} sequences)")
        fetched = engine.pop("fetched_bytes", None)
        if fetched is not None:
            log(f"fetched {int(fetched) / 2**20:.1f} MiB of the workers' parts through vLLM")
        meta = {
            "model": model,
            "kv_cache_dtype": kv_cache_dtype,
            **engine,  # what vLLM ran with: block_size, max_model_len, vllm_version
            "prompts_file": os.path.basename(prompts_file),
            "prompts_sha256": prompts_sha,
            "tokenizer": tokenizer or model,
            # the drafter whose KV layers were recorded with the target's ("" without one)
            "speculative_config": json.dumps(spec, sort_keys=True, default=str) if spec else "",
            # which drafter by content, not path (connector/drafter.py); "" without a drafter folder
            "drafter_identity": drafter_identity(spec.get("model")) if spec else "",
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        bank = assemble(work, unique, meta, out)
        if budget is not None and bank.nbytes > budget:
            raise RecordError(f"the recorded bank takes {bank.nbytes / 2**30:.3f} GiB, over --budget-gib "
                              f"{budget_gib}; nothing written")
        _write(bank, out, work)
    log(f"wrote {bank.describe()}")
    return bank


def _state_estimate(est, budget: int | None, budget_gib, log):
    """The check ``run_vllm`` makes once vLLM's engine config is built, before
    any worker starts: with recurrent state, the estimate with the state
    section (vLLM's state shapes, ``connector.states``), against the budget."""
    def check(config) -> None:
        from kvfill.connector.states import state_bytes_per_sequence

        per_sequence = state_bytes_per_sequence(config)
        if not per_sequence:
            return
        full = dataclasses.replace(est, state_bytes_per_sequence=per_sequence)
        log(f"bank estimate with the state section: {full}")
        if budget is not None and full.nbytes > budget:
            raise RecordError(f"the bank would take ~{full.nbytes / 2**30:.3f} GiB with its recurrent state, over "
                              f"--budget-gib {budget_gib}; record fewer prompts")
    return check


def _spec_dict(llm_kwargs: dict) -> dict:
    """The recording's speculative config, from ``--speculative-config`` and
    vLLM's ``--spec-method``/``--spec-model``/``--spec-tokens`` (under the
    config's own key names); {} without one."""
    spec = llm_kwargs.get("speculative_config") or {}
    spec = dict(spec) if isinstance(spec, dict) else {"config": str(spec)}
    for flag, key in (("spec_method", "method"), ("spec_model", "model"), ("spec_tokens", "num_speculative_tokens")):
        if llm_kwargs.get(flag) is not None:
            spec[key] = llm_kwargs[flag]
    return spec


@contextlib.contextmanager
def _work_dir(out: str):
    """A work folder beside ``out`` (the bank is moved, not copied, into
    place), removed at the end unless the bank could not be written."""
    try:
        work = tempfile.mkdtemp(prefix="kvfill-record-", dir=os.path.dirname(os.path.abspath(out)))
    except OSError as exc:
        raise RecordError(f"--out {out!r}: cannot make the work folder beside it ({exc.strerror}); expected a "
                          f"writable folder") from None
    keep = False
    try:
        yield work
    except _WriteFailed:
        keep = True
        raise
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _write(bank: Bank, out: str, work: str) -> None:
    """Saved in the work folder, then renamed to ``out`` (one filesystem):
    ``out`` is replaced whole or not at all, and a failure keeps what the
    run recorded - the rows, or the saved bank - and says where."""
    staged = os.path.join(work, "bank.safetensors")
    try:
        bank.save(staged)
    except Exception as exc:  # OSError, or safetensors' own error for an I/O failure
        raise _WriteFailed(f"saving the bank failed ({exc}); nothing written to --out {out!r}; the recorded rows "
                           f"are kept in {work!r} (one .safetensors file per prompt)") from exc
    try:
        os.replace(staged, out)
    except OSError as exc:
        raise _WriteFailed(f"--out {out!r} cannot be written ({exc.strerror}); the recorded bank is kept at "
                           f"{staged!r}: move it into place") from exc
