"""A recording on several nodes (``kvfill.record``, vLLM's multiprocessing
executor with ``--nnodes``): node 0 ends the other nodes' part
(``end_nodes``), and every other node's kvfill-record only hosts its workers
until then (``host_workers``).
"""
from __future__ import annotations

import inspect
import multiprocessing.connection
import os
import signal
import threading

from .engine import _private_tempdir, env_defaults
from .engine_config import check_engine_config, engine_kwargs, given_flags, vllm_failed
from .inputs import RecordError
from .liveness import NODE_SILENCE_S, NODE_WAIT_S, NodeLost, watching
from .transfer import drop_parts


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


@env_defaults(VLLM_CPU_KVCACHE_SPACE="2")
def host_workers(model, token_ids, dtype, kv_cache_dtype, block_size, max_model_len, llm_kwargs,
                 tokenizer=None, log=print, node_wait: float = NODE_WAIT_S,
                 node_silence: float = NODE_SILENCE_S) -> None:
    """A node other than the first (``--node-rank`` > 0 with ``--nnodes``):
    start this node's workers of the recording as vLLM's headless node does
    (its ``MultiprocExecutor``; they join the first node's engine at
    ``--master-addr``), and stop them when the first node ends the recording
    (``rpc_end_node``: SIGUSR1 from a worker), a worker dies, a signal
    stops this process, or the first node does not come up within
    ``node_wait`` seconds or goes away (``liveness.watching``: this node's
    last word, why it leaves, reaches the first node through the store).  The engine flags are derived as the first node's
    (the same command line), and checked there (``engine_digest``).  Writes
    nothing; what the workers saved they dropped when fetched."""
    from vllm.platforms import current_platform
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    node = int(llm_kwargs["node_rank"])
    # the workers never write into record_dir: it names their parts' folders, removed here whatever the end
    # (a worker killed by its executor's shutdown leaves its folder)
    record_dir = f"kvfill-record-node{node}-{os.getpid()}"
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
                # watched from before the workers start: vLLM's own wait for the first node has no bound
                with watching(llm_kwargs, node_wait, log, ended, node_silence) as watch:
                    log(f"node {node} of {config.parallel_config.nnodes}: starting this node's workers; they join "
                        f"the first node at {config.parallel_config.master_addr}:"
                        f"{config.parallel_config.master_port} (waiting up to --node-wait {node_wait:g} s for it)")
                    executor = MultiprocExecutor(config, monitor_workers=False)
                    sentinels = [w.proc.sentinel for w in executor.workers]
                    while not ended.is_set() and watch.reason is None and \
                            not multiprocessing.connection.wait(sentinels, timeout=0.2):
                        pass
                    if watch.reason is not None:
                        raise NodeLost(watch.reason)
                    if not ended.is_set():
                        raise RecordError(f"node {node}: a worker of this node stopped before the first node ended "
                                          f"the recording (vLLM's log above says why; the first node's error names "
                                          f"the recording's fate)")
            except (KeyboardInterrupt, SystemExit, RecordError):
                raise
            except Exception as exc:
                raise RecordError(vllm_failed(exc, kw, token_ids)) from exc
            finally:
                if executor is not None:
                    executor.shutdown()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        drop_parts(record_dir)
    log(f"node {node}: the first node ended the recording; this node's workers stopped, nothing left here")
