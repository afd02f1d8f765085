"""The recording's vLLM engine flags (``kvfill.record``): ``LLM``'s kwargs
(``engine_kwargs``) and their digest every node checks (``engine_digest``),
vLLM's whole engine config built before a worker starts
(``check_engine_config``: a flag vLLM refuses is one line naming the flags
given), and vLLM's failures put in one line (``vllm_failed``).
"""
from __future__ import annotations

import hashlib
import json
import tempfile

from .inputs import RecordError


# vLLM CPU's pipeline parallelism fails in eager mode: a later stage's worker
# never allocates its intermediate tensors (AssertionError in
# sync_and_gather_intermediate_tensors, then a KeyError in the scheduler),
# whatever the prompts; its compile warm-up allocates them.
_CPU_PP_EAGER = ("vLLM CPU's pipeline parallelism fails in eager mode (a later stage never gets its intermediate "
                 "tensors: vLLM's AssertionError, whatever the prompts), and vLLM runs on its CPU platform here "
                 "(other platforms are not refused); leave --enforce-eager out, the recorder then runs PP compiled")


def engine_kwargs(model, token_ids, record_dir, dtype, kv_cache_dtype, block_size, max_model_len, llm_kwargs,
                  tokenizer, cpu: bool = False) -> dict:
    """``LLM(**kwargs)`` of the recording: the recorder's settings, the
    user's engine flags (``llm_kwargs``) over them.  Compiled or eager as
    vLLM's defaults and the user's flags say, as ``vllm serve`` would run:
    eager and compiled kernels round differently, so a bank holds the
    serving run's bits only when recorded in its mode (``--enforce-eager``
    records eager) - except that pipeline parallelism on vLLM CPU (``cpu``)
    fails eager (``_CPU_PP_EAGER``), so asking for it is refused."""
    cpu_pp = cpu and int(llm_kwargs.get("pipeline_parallel_size") or 1) > 1
    if cpu_pp and llm_kwargs.get("enforce_eager"):
        raise RecordError(f"--enforce-eager with --pipeline-parallel-size {llm_kwargs['pipeline_parallel_size']}: "
                          + _CPU_PP_EAGER)
    kw = dict(
        model=model,
        # The recorder's own tokenizer: with skip_tokenizer_init, vLLM's chat
        # template warm-up fails and logs a traceback as a warning (several
        # times) that reads as a failure; token ids go in either way.
        tokenizer=tokenizer,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=max_model_len,
        # whole prompts per step: at least max_model_len (vLLM's rule without chunked prefill)
        max_num_batched_tokens=max(max_model_len, 2048),
        max_num_seqs=min(len(token_ids), 16),
        enable_prefix_caching=False,  # every prompt prefilled for real, in its own blocks
        # Each prompt prefilled in one step: with chunks, vLLM frees sliding-window
        # blocks behind the window between chunks, before the rows are read.
        enable_chunked_prefill=False,
        disable_log_stats=True,
        kv_transfer_config={
            "kv_connector": "KVFillConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"record_dir": record_dir},
        },
    )
    if block_size:
        kw["block_size"] = block_size
    kw.update(llm_kwargs)
    extra = kw["kv_transfer_config"]["kv_connector_extra_config"]
    extra["record_flags"] = flags = engine_flags(kw)  # the drafter's content hashed once
    extra["record_engine"] = engine_digest(flags)
    return kw


# Engine flags a node's kvfill-record may set its own way: which node it is,
# and paths (each node has its own disk; the same model may sit elsewhere).
# A drafter's path is replaced by its content's identity (``_drafter_by_content``).
_NODE_OWN = ("node_rank", "model", "tokenizer", "kv_transfer_config")


def engine_flags(kw: dict) -> dict[str, str]:
    """Each engine flag of the recording but ``_NODE_OWN``, as a short digest
    of its value: every worker reports them to the first node at start (the
    connector's handshake), which names the flags a node differs in."""
    same = {k: v for k, v in sorted(kw.items()) if k not in _NODE_OWN}
    for key in ("speculative_config", "spec_model"):
        if same.get(key) is not None:
            same[key] = _drafter_by_content(same[key])
    return {k: hashlib.sha256(json.dumps(v, sort_keys=True, default=repr).encode()).hexdigest()[:12]
            for k, v in same.items()}


def _drafter_by_content(value):
    """A speculative config (or ``--spec-model``) with the drafter's folder
    named by its content (``connector.drafter.drafter_identity``), not its
    path, which may differ per node; a hub name or none stays as given."""
    from kvfill.connector.drafter import drafter_identity

    if isinstance(value, str):
        return drafter_identity(value) or value
    if isinstance(value, dict) and isinstance(value.get("model"), str):
        return {**value, "model": drafter_identity(value["model"]) or value["model"]}
    return value


def engine_digest(flags: dict[str, str]) -> str:
    """A digest of the recording's engine flags (``engine_flags``): every
    node's kvfill-record computes it from its own command line, and the
    first node refuses a node whose digest differs - its workers would run
    another model shape, length or numerics."""
    text = json.dumps(flags, sort_keys=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _flags(names) -> str:
    return ", ".join(f"--{n.replace('_', '-')}" for n in names) or "none beyond the recorder's own"


def given_flags(llm_kwargs: dict, dtype: str, kv_cache_dtype: str, block_size) -> list[str]:
    """The engine flags the user gave: those in ``llm_kwargs`` and the named
    ones set (what ``check_engine_config``'s refusal lists)."""
    return list(llm_kwargs) + [k for k, v in (("dtype", dtype != "auto"), ("kv_cache_dtype", kv_cache_dtype != "auto"),
                                              ("block_size", block_size)) if v]


def check_engine_config(kw: dict, given: list[str], headless: bool = False):
    """Build vLLM's whole engine config from ``kw`` as ``LLM`` does (as a
    headless node's with ``headless``), so vLLM's refusal of a flag
    (``given``: the user's) is one line before any worker starts, not a
    pydantic traceback after it.  Returns the config."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    args = dict(kw, kv_transfer_config=KVTransferConfig(**kw["kv_transfer_config"]))
    try:
        return EngineArgs(**args).create_engine_config(headless=headless)
    except (ValueError, TypeError, AssertionError, NotImplementedError) as exc:
        raise RecordError(f"vLLM refuses this engine configuration: {_first_message(exc)} (engine flags given: "
                          f"{_flags(given)})") from None


def _first_message(exc: BaseException) -> str:
    """vLLM's own words: a pydantic error's first message, else the first line."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            msg = errors()[0].get("msg", "")
            if msg:
                return str(msg).removeprefix("Value error, ")
        except Exception:  # noqa: BLE001  (not pydantic's after all)
            pass
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def vllm_failed(exc: BaseException, kw: dict, token_ids) -> str:
    """One line for a failure inside vLLM's run: whose it is, with what
    input, and advice that fits the cause (``_rendezvous_lost``: the
    workers' rendezvous file gone is no matter of parallel sizes)."""
    lengths = [len(t) for t in token_ids]
    parallel = ", ".join(f"--{k.replace('_', '-')} {kw[k]}" for k in ("tensor_parallel_size", "pipeline_parallel_size")
                         if int(kw.get(k) or 1) > 1)
    head = (f"vLLM failed while starting or prefilling ({_first_message(exc)}): a failure of vLLM's own, not an "
            f"input the recorder refused; it ran {len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens"
            f"{' with ' + parallel if parallel else ''} (vLLM's log above names the failing worker)")
    rendezvous = f"{tempfile.gettempdir()}/kvfill-record-vllm-*/vllm_dist_<id>"  # record/engine.py's _private_tempdir
    if _rendezvous_lost(exc):
        return (f"{head}. The workers lost their rendezvous file, {rendezvous} (torch's FileStore they meet "
                f"through, made in a temp folder of the run's own under TMPDIR as the engine starts): something "
                f"removed it while the run went on. Check that nothing cleans TMPDIR during a recording (a temp "
                f"cleaner such as systemd-tmpfiles or tmpwatch, another job emptying it) and that TMPDIR is a "
                f"local, writable folder every process of the run sees; then run the same command again (other "
                f"parallel sizes would not help)")
    return (f"{head}. If that log names a missing file {rendezvous} (the workers' rendezvous), something removed "
            f"the run's temp folder: check that nothing cleans TMPDIR during a recording; otherwise retry with "
            f"other parallel sizes or prompts, or report it to vLLM with that log")


def _rendezvous_lost(exc: BaseException) -> bool:
    """torch's FileStore whose file vanished raises ``DistStoreError: No such
    file or directory``; vLLM may wrap it (the chain is searched)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = f"{type(exc).__name__}: {exc}"
        if "vllm_dist_" in text or ("DistStoreError" in text and "No such file or directory" in text):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
