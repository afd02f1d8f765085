"""The recorder's vLLM run (``kvfill.record``).

``run_vllm``: real prefill of the prompts with KVFillConnector in its record
role.  vLLM's whole engine config is built first (``engine_config.py``), so a
flag vLLM refuses (``--tensor-parallel-size 3`` for 8 KV heads) is one line
naming the flags given, before a worker starts; a failure of vLLM's own while
it prefills is one line saying it is vLLM's and with what input.  Whatever
happens, the engine is shut down (``engine.llm_engine``) before the call
returns or raises.  A model with recurrent state is prefilled without the
last tokens of each prompt, which a serving run computes itself
(``state_tail``, ``without_tail``).
"""
from __future__ import annotations

import os

from .engine import env_defaults, llm_engine, multiprocessing_error
from .engine_config import check_engine_config, engine_kwargs, given_flags, vllm_failed
from .inputs import RecordError
from .liveness import NODE_SILENCE_S, NODE_WAIT_S, NodeLost, watching
from .nodes import end_nodes
from .transfer import drop_parts, fetch_parts


@env_defaults(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2")
def run_vllm(model, token_ids, record_dir, dtype, kv_cache_dtype, block_size, max_model_len, llm_kwargs,
             tokenizer=None, check_config=None, node_wait: float = NODE_WAIT_S, log=print,
             node_silence: float = NODE_SILENCE_S) -> dict[str, str]:
    """Real prefill of every prompt (its recorded tokens, one output token)
    with the record role on, each prompt's positions recorded whole;
    returns the run's provenance: the vLLM version, and the max_model_len,
    cache block size (its own when not given) and compilation
    (``bank_checks.compilation_of``) vLLM ran with.

    ``max_model_len``: the user's (the serving run's gives its bits exactly:
    vLLM CPU's attention rounds differently with it, so the KV of positions
    past the first block differs in the last bits from a run with another
    one), or ``inputs.default_max_model_len``.  ``check_config``: called
    with vLLM's engine config once it is built, before any worker starts
    (the recorder's estimate of the state section).  Over several nodes,
    the other nodes are watched from before the workers start until this
    node ends them (``liveness.watching``: ``node_wait`` seconds for each to
    join, ``node_silence`` seconds without a beat from one that joined; one
    gone fails the recording naming it)."""
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    from kvfill.connector.bank_checks import compilation_of
    from kvfill.connector.recorder import rpc_end_node

    line = multiprocessing_error()
    if line:  # before any engine: after it, every prompt prefilled, fetching the parts would fail
        raise RecordError(line)
    kw = engine_kwargs(model, token_ids, record_dir, dtype, kv_cache_dtype, block_size, max_model_len, llm_kwargs,
                       tokenizer, cpu=current_platform.is_cpu())
    config = check_engine_config(kw, given_flags(llm_kwargs, dtype, kv_cache_dtype, block_size))
    if check_config is not None:
        check_config(config)
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False, temperature=0.0)
    try:
        with watching(llm_kwargs, node_wait, log, silence_s=node_silence) as watch, llm_engine(**kw) as llm:
            try:
                tail = state_tail(llm.llm_engine.vllm_config)
                sent = without_tail(token_ids, tail)
                llm.generate([TokensPrompt(prompt_token_ids=t) for t in sent], params, use_tqdm=False)
                fetched = fetch_parts(llm, record_dir)
            finally:  # success, or a failure already named: what the other nodes do meanwhile is theirs
                if watch is not None:
                    watch.stop()
            end_nodes(llm, rpc_end_node)  # the other nodes leave now, as told
            config = llm.llm_engine.vllm_config
    except NodeLost:
        drop_parts(record_dir)  # its workers were killed: they could not drop theirs
        raise
    except (KeyboardInterrupt, SystemExit, RecordError):
        raise
    except Exception as exc:
        if str(exc).startswith("KVFillConnector:"):  # the connector's own refusal, whole (it names the worker)
            raise RecordError(str(exc)) from exc
        raise RecordError(vllm_failed(exc, kw, token_ids)) from exc
    return {"block_size": str(config.cache_config.block_size),
            "max_model_len": str(config.model_config.max_model_len),
            "vllm_version": getattr(vllm, "__version__", "unknown"),
            "compilation": compilation_of(config),
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
