"""The recorder's vLLM run (``kvfill.record``), and what stops it.

* ``run_vllm``: real prefill of the prompts with KVFillConnector in its
  record role.  vLLM's whole engine config is built first, so a flag vLLM
  refuses (``--tensor-parallel-size 3`` for 8 KV heads) is one line naming
  the flags given, before a worker starts; a failure of vLLM's own while it
  prefills is one line saying it is vLLM's and with what input.  Whatever
  happens, the engine is shut down as vLLM's own entry points do (its
  executor stops and reaps its workers) before the call returns or raises,
  so no worker writes into the work folder afterwards, and the files vLLM's
  CPU backend leaves (its FileStore rendezvous in the temp folder, its
  shared-memory all-reduce segments in /dev/shm) are removed.
* ``stop_signals``: SIGTERM and SIGINT (``kill``, a job scheduler, Ctrl-C,
  which a terminal sends to vLLM's workers too) stop the recording as an
  exception in the main thread, and whatever error vLLM turns the signal
  into (its workers die first: ``RuntimeError: cancelled``) is reported as
  the signal: KeyboardInterrupt (exit 130) or SystemExit(128 + signum).
"""
from __future__ import annotations

import contextlib
import gc
import glob
import hashlib
import inspect
import json
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
import weakref
from types import SimpleNamespace

from .inputs import RecordError

SHM = "/dev/shm"


@contextlib.contextmanager
def stop_signals():
    """SIGTERM and SIGINT raise in the main thread while the recorder runs
    (module docstring); a second one is ignored, so it does not cut the
    cleanup short.  Only the main thread can handle signals, and a handler
    the caller installed is left alone.  Yields the state: ``signum``."""
    state = SimpleNamespace(signum=None)
    defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    installed = {s: signal.getsignal(s) for s, d in defaults.items() if signal.getsignal(s) is d}

    def stop(signum, frame):
        for s in installed:
            signal.signal(s, signal.SIG_IGN)
        if state.signum is None:
            state.signum = signum
            raise _exception(signum)

    for s in installed:
        signal.signal(s, stop)
    try:
        yield state
    except BaseException as exc:
        if state.signum is None or (isinstance(exc, (KeyboardInterrupt, SystemExit))
                                    and type(exc) is type(_exception(state.signum))):
            raise
        raise _exception(state.signum) from exc  # vLLM's error for it: the signal is what happened
    finally:
        for s, handler in installed.items():
            signal.signal(s, handler)


def _exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)


# vLLM CPU's pipeline parallelism fails in eager mode: a later stage's worker
# never allocates its intermediate tensors (AssertionError in
# sync_and_gather_intermediate_tensors, then a KeyError in the scheduler),
# whatever the prompts; its compile warm-up allocates them.
_CPU_PP_EAGER = ("vLLM CPU's pipeline parallelism fails in eager mode (a later stage never gets its intermediate "
                 "tensors: vLLM's AssertionError, whatever the prompts); leave --enforce-eager out, the recorder "
                 "then runs PP compiled")


def engine_kwargs(model, token_ids, record_dir, dtype, kv_cache_dtype, block_size, max_model_len, llm_kwargs,
                  tokenizer, cpu: bool = False) -> dict:
    """``LLM(**kwargs)`` of the recording: the recorder's settings, the
    user's engine flags (``llm_kwargs``) over them.  Eager unless the user
    says otherwise - but compiled for pipeline parallelism on vLLM CPU
    (``cpu``), which fails eager (``_CPU_PP_EAGER``)."""
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
        enforce_eager=not cpu_pp,
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
    kw["kv_transfer_config"]["kv_connector_extra_config"]["record_engine"] = engine_digest(kw)
    return kw


# Engine flags a node's kvfill-record may set its own way: which node it is,
# and paths (each node has its own disk; the same model may sit elsewhere).
_NODE_OWN = ("node_rank", "model", "tokenizer", "kv_transfer_config")


def engine_digest(kw: dict) -> str:
    """A digest of the recording's engine flags but ``_NODE_OWN``: every
    node's kvfill-record computes it from its own command line, and every
    worker reports it to the first node at start (the connector's handshake),
    which refuses a node whose flags differ - its workers would run another
    model shape, length or numerics."""
    same = {k: v for k, v in sorted(kw.items()) if k not in _NODE_OWN}
    text = json.dumps(same, sort_keys=True, default=repr)
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
    """One line for a failure inside vLLM's run: whose it is and with what input."""
    lengths = [len(t) for t in token_ids]
    parallel = ", ".join(f"--{k.replace('_', '-')} {kw[k]}" for k in ("tensor_parallel_size", "pipeline_parallel_size")
                         if int(kw.get(k) or 1) > 1)
    return (f"vLLM failed while starting or prefilling ({_first_message(exc)}): a failure of vLLM's own, not an "
            f"input the recorder refused; it ran {len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens"
            f"{' with ' + parallel if parallel else ''} (vLLM's log above names the failing worker). Retry with "
            f"other parallel sizes or prompts, or report it to vLLM with that log")


@contextlib.contextmanager
def _private_tempdir():
    """vLLM's rendezvous file (``vllm_dist_<id>``, made by the engine's
    process in ``tempfile.gettempdir()``) goes into a folder of the run's
    own; its name is the prefix of the shared-memory segments vLLM CPU's
    workers make.  Yields a function returning the ids seen so far; the
    folder and every segment of those ids are removed at the end."""
    folder = tempfile.mkdtemp(prefix="kvfill-record-vllm-")
    before, ids = tempfile.tempdir, set()

    def seen() -> set[str]:
        ids.update(os.path.basename(p) for p in glob.glob(os.path.join(folder, "vllm_dist_*")))
        return ids

    tempfile.tempdir = folder
    try:
        yield seen
    finally:
        tempfile.tempdir = before
        remove_vllm_tempdir(folder, seen())


def remove_vllm_tempdir(folder: str, idents=()) -> None:
    """A stopped vLLM run's temp folder (``TMPDIR`` of a server kvfill
    started, or ``_private_tempdir``), with the shared-memory segments of
    the rendezvous ids it held or ``idents`` names."""
    idents = set(idents) | {os.path.basename(p) for p in glob.glob(os.path.join(folder, "vllm_dist_*"))}
    for ident in idents:
        for path in glob.glob(os.path.join(SHM, glob.escape(ident) + "-*")):
            with contextlib.suppress(OSError):
                os.unlink(path)
    shutil.rmtree(folder, ignore_errors=True)


def _executors() -> list:
    from vllm.v1.executor.abstract import Executor

    return [o for o in gc.get_objects() if isinstance(o, Executor)]


def _stop_executors_since(before) -> None:
    """A start that failed after vLLM's workers came up (a refusal in the
    engine core's init, e.g. the bank check) leaves its executor alive until
    this process exits (its finalizer holds it): stop the executors made
    since ``before`` (a WeakSet) now, so their workers go with the failure."""
    for executor in _executors():
        if executor not in before:
            with contextlib.suppress(Exception):
                executor.shutdown()


def shutdown(llm) -> None:
    """Stop vLLM's engine as its entry points do: the engine core's
    shutdown stops the executor, which reaps its workers (killing those that
    do not exit), and tears down the distributed state."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()


@contextlib.contextmanager
def llm_engine(**kwargs):
    """vLLM's ``LLM(**kwargs)``, stopped on leaving (``shutdown``: its workers
    reaped) with the files vLLM CPU's workers leave removed: what kvfill
    starts, it cleans up.  The recorder and the bench scripts run engines so."""
    from vllm import LLM

    before = weakref.WeakSet(_executors())
    with _private_tempdir() as seen:
        try:
            llm = LLM(**kwargs)
        except BaseException:
            _stop_executors_since(before)
            raise
        try:
            seen()  # the rendezvous file exists while the workers run
            yield llm
        finally:
            shutdown(llm)


CHUNK_BYTES = 32 << 20  # the most of a part one RPC message carries


def fetch_parts(llm, work: str) -> int:
    """Every worker's parts into ``work`` through vLLM's own channel to its
    workers (``collective_rpc``: every executor backend, any number of
    nodes), in chunks of at most ``CHUNK_BYTES``; then the workers drop
    theirs.  Returns the bytes fetched."""
    from kvfill.connector.recorder import rpc_drop_parts, rpc_list_parts, rpc_read_part

    total = 0
    for part_id, files in llm.collective_rpc(rpc_list_parts):
        for name, size in files:
            dst = os.path.join(work, os.path.basename(name))
            with open(dst + ".part", "wb") as f:
                for offset in range(0, size, CHUNK_BYTES):
                    want = min(CHUNK_BYTES, size - offset)
                    got = [c for c in llm.collective_rpc(rpc_read_part, args=(part_id, name, offset, want))
                           if c is not None]
                    if len(got) != 1 or len(got[0]) != want:
                        raise RuntimeError(f"part {name} of worker {part_id}: {want} bytes at {offset} arrived as "
                                           f"{[len(c) for c in got]} (the worker's file changed or went)")
                    f.write(got[0])
            os.replace(dst + ".part", dst)
            total += size
    llm.collective_rpc(rpc_drop_parts)
    return total


def end_nodes(llm, rpc_end_node) -> None:
    """The other nodes' kvfill-record stop their workers (``rpc_end_node``).
    With the engine core in this process (the recorder's default) only the
    first rank replies, so the other nodes' workers exit at once; else each
    replies and its node stops it as vLLM's executor does (after a grace
    period)."""
    core = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "engine_core", None)
    executor = getattr(core, "model_executor", None)
    if executor is not None and "unique_reply_rank" in inspect.signature(executor.collective_rpc).parameters:
        executor.collective_rpc(rpc_end_node, args=(False,), unique_reply_rank=0)
    else:
        llm.collective_rpc(rpc_end_node, args=(True,))


def run_vllm(model, token_ids, record_dir, dtype, kv_cache_dtype, block_size, max_model_len, llm_kwargs,
             tokenizer=None) -> dict[str, str]:
    """Real prefill of every prompt (its recorded tokens, one output token)
    with the record role on, each prompt's positions recorded whole;
    returns the run's provenance: the vLLM version, and the max_model_len and
    cache block size vLLM ran with (its own block size when not given).

    ``max_model_len``: the user's (the serving run's gives its bits exactly:
    vLLM CPU's attention rounds differently with it, so the KV of positions
    past the first block differs in the last bits from a run with another
    one), or ``inputs.default_max_model_len``."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    from kvfill.connector.recorder import rpc_end_node

    kw = engine_kwargs(model, token_ids, record_dir, dtype, kv_cache_dtype, block_size, max_model_len, llm_kwargs,
                       tokenizer, cpu=current_platform.is_cpu())
    check_engine_config(kw, given_flags(llm_kwargs, dtype, kv_cache_dtype, block_size))
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False, temperature=0.0)
    try:
        with llm_engine(**kw) as llm:
            tail = state_tail(llm.llm_engine.vllm_config)
            sent = without_tail(token_ids, tail)
            llm.generate([TokensPrompt(prompt_token_ids=t) for t in sent], params, use_tqdm=False)
            fetched = fetch_parts(llm, record_dir)
            end_nodes(llm, rpc_end_node)
            config = llm.llm_engine.vllm_config
    except (KeyboardInterrupt, SystemExit, RecordError):
        raise
    except Exception as exc:
        if str(exc).startswith("KVFillConnector:"):  # the connector's own refusal, whole (it names the worker)
            raise RecordError(str(exc)) from exc
        raise RecordError(vllm_failed(exc, kw, token_ids)) from exc
    return {"block_size": str(config.cache_config.block_size),
            "max_model_len": str(config.model_config.max_model_len),
            "vllm_version": getattr(vllm, "__version__", "unknown"),
            "state_tail": str(tail),
            "fetched_bytes": str(fetched)}


def state_tail(vllm_config) -> int:
    """How many of each prompt's last tokens a recording of a model with
    recurrent state leaves out (0: none): the tokens a serving run computes
    itself (``scheduler.computed_tail``), so the state recorded after the
    rest is the one a replayed request continues from (``bank/state.py``)."""
    from kvfill.connector.scheduler import computed_tail
    from kvfill.connector.states import has_recurrent_state

    if not has_recurrent_state(vllm_config.model_config):
        return 0
    return computed_tail(vllm_config)


def without_tail(token_ids, tail: int) -> list[list[int]]:
    """Each prompt without its last ``tail`` tokens (one token at least),
    each distinct prompt once, in first-seen order."""
    out, seen = [], set()
    for t in token_ids:
        cut = list(t[:max(1, len(t) - tail)])
        key = tuple(cut)
        if key not in seen:
            seen.add(key)
            out.append(cut)
    return out


def _listening(host: str, port: int) -> bool:
    """Whether the first node's rendezvous (torch.distributed's store, served
    by its rank 0 for the engine's life) still accepts connections: vLLM's
    workers on a further node wait on the first node's queue forever when it
    is gone."""
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        return False
    return True


def host_workers(model, token_ids, dtype, kv_cache_dtype, block_size, max_model_len, llm_kwargs,
                 tokenizer=None, log=print) -> None:
    """A node other than the first (``--node-rank`` > 0 with ``--nnodes``):
    start this node's workers of the recording as vLLM's headless node does
    (its ``MultiprocExecutor``; they join the first node's engine at
    ``--master-addr``), and stop them when the first node ends the recording
    (``rpc_end_node``: SIGUSR1 from a worker), a worker dies, or a signal
    stops this process.  The engine flags are derived as the first node's
    (the same command line), and checked there (``engine_digest``).  Writes
    nothing; what the workers saved they dropped when fetched."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm.platforms import current_platform
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    node = int(llm_kwargs["node_rank"])
    # the workers never write into record_dir: it names their parts' folders, removed here whatever the end
    # (a worker killed by its executor's shutdown leaves its folder)
    record_dir = f"kvfill-record-node{node}-{os.getpid()}"
    parts = os.path.join(tempfile.gettempdir(), f"kvfill-parts-{record_dir}-*")
    kw = engine_kwargs(model, token_ids, record_dir, dtype, kv_cache_dtype, block_size,
                       max_model_len, llm_kwargs, tokenizer, cpu=current_platform.is_cpu())
    if (kw.get("distributed_executor_backend") or "mp") != "mp":
        raise RecordError(f"--node-rank {node}: this node hosts workers through vLLM's multiprocessing executor; "
                          f"got --distributed-executor-backend {kw['distributed_executor_backend']} (with Ray, "
                          f"start the recording on the Ray head only)")
    config = check_engine_config(kw, given_flags(llm_kwargs, dtype, kv_cache_dtype, block_size), headless=True)
    ended = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: ended.set())
    executor = None
    try:
        with _private_tempdir():
            try:
                log(f"node {node} of {config.parallel_config.nnodes}: starting this node's workers; they join the "
                    f"first node at {config.parallel_config.master_addr}:{config.parallel_config.master_port}")
                executor = MultiprocExecutor(config, monitor_workers=False)
                sentinels = [w.proc.sentinel for w in executor.workers]
                head = (config.parallel_config.master_addr, config.parallel_config.master_port)
                polls = 0
                while not ended.is_set() and not multiprocessing.connection.wait(sentinels, timeout=0.2):
                    polls += 1
                    if polls % 10 == 0 and not ended.is_set() and not _listening(*head):
                        for w in executor.workers:  # blocked on a queue nobody writes: no grace period
                            w.proc.kill()
                        raise RecordError(f"node {node}: the first node's engine at {head[0]}:{head[1]} stopped "
                                          f"before it ended the recording (its own error says why); this node's "
                                          f"workers stopped")
            except (KeyboardInterrupt, SystemExit, RecordError):
                raise
            except Exception as exc:
                raise RecordError(vllm_failed(exc, kw, token_ids)) from exc
            finally:
                if executor is not None:
                    executor.shutdown()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        for folder in glob.glob(parts):
            shutil.rmtree(folder, ignore_errors=True)
    if not ended.is_set():
        raise RecordError(f"node {node}: a worker of this node stopped before the first node ended the recording "
                          f"(vLLM's log above says why; the first node's error names the recording's fate)")
    log(f"node {node}: the first node ended the recording; this node's workers stopped, nothing left here")
