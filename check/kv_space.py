"""kvfill-check's KV space on vLLM CPU (``VLLM_CPU_KVCACHE_SPACE``): sized
from the prompts (and decoys) x max_model_len over the model's KV bytes
per token, unless the user set it; a host whose available memory cannot
hold it and the weights is refused before any step.  vLLM CPU's own
default, 0.92 of the NUMA node, fails to start on a host with less free.
"""
from __future__ import annotations

import math
import os

from . import probes
from .cli import CheckConfig, CheckError, on_cpu
from .env_checks import given_kv_space

GiB = 2**30
KV_MARGIN = 1.25  # the sized KV space over the estimate (vLLM's blocks, a hybrid's page padding)
CPU_BLOCK_SIZE = 128  # vLLM CPU's block size unless --block-size
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def kv_space(cfg: CheckConfig, prompts: int, max_len: int) -> dict | None:
    """On vLLM CPU, each engine's KV space: ``{"gib": N, "source": why}``,
    the user's ``VLLM_CPU_KVCACHE_SPACE``, else sized for every sequence a
    run holds at once (the prompts, and the decoys with ``--decoys``) at
    ``max_len`` tokens (whole blocks), of the model's KV bytes per token
    over its layers (the drafter's too; kvfill-record's ``estimate``), plus
    a hybrid's recurrent state per sequence, per worker of TP x PP; times
    KV_MARGIN, in whole GiB (vLLM reads an int).  Without it vLLM CPU takes
    0.92 of the NUMA node and refuses to start on a host with less free.
    CheckError when this host's available memory is short of the KV space
    of every worker plus the model's weights.  None elsewhere (a GPU sizes
    its cache by itself)."""
    if not on_cpu():
        return None
    tp = int(cfg.engine.get("tensor_parallel_size") or 1)
    pp = int(cfg.engine.get("pipeline_parallel_size") or 1)
    try:
        gib = given_kv_space()
    except ValueError as exc:
        raise CheckError(str(exc)) from None
    if gib is not None:
        kv = {"gib": gib, "source": "VLLM_CPU_KVCACHE_SPACE set by the user"}
    else:
        kv = sized_kv_space(cfg, prompts, max_len)
    _check_host_memory(cfg, kv, tp * pp)
    return kv


def kv_env(kv: dict | None) -> dict:
    """The steps' environment for the KV space ``kv`` sized (a user's
    ``VLLM_CPU_KVCACHE_SPACE`` is in the environment already)."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv["gib"])} if kv and kv["source"].startswith("sized") else {}


def sized_kv_space(cfg: CheckConfig, prompts: int, max_len: int) -> dict:
    """``kv_space``'s figure sized for ``prompts`` at ``max_len`` (the host not asked)."""
    from kvfill.record.inputs import estimate, with_drafter
    from kvfill.record.recording import _spec_dict

    tp = int(cfg.engine.get("tensor_parallel_size") or 1)
    pp = int(cfg.engine.get("pipeline_parallel_size") or 1)

    trust = bool(cfg.engine.get("trust_remote_code", False))
    dtype, kv_dtype = cfg.engine.get("dtype") or "auto", cfg.engine.get("kv_cache_dtype") or "auto"
    sequences = prompts * (2 if cfg.decoys else 1)
    block = int(cfg.engine.get("block_size") or CPU_BLOCK_SIZE)
    tokens = -(-max_len // block) * block
    try:
        est = estimate(cfg.model, sequences, sequences * tokens, dtype, kv_dtype, trust_remote_code=trust)
    except Exception as exc:  # noqa: BLE001 - a config transformers cannot read: the steps' vLLM says more
        raise CheckError(f"--model {cfg.model!r}: its config cannot be read to size the KV space "
                         f"({type(exc).__name__}: {str(exc)[:200]}); expected a model transformers reads, or "
                         f"VLLM_CPU_KVCACHE_SPACE set (GiB per engine)") from None
    spec, drafter = _spec_dict(cfg.engine), ""
    if spec:
        try:
            with_draft = with_drafter(est, cfg.model, spec, dtype, kv_dtype, trust_remote_code=trust)
            drafter = f", the drafter's {with_draft.layers - est.layers} included" if with_draft.layers > est.layers \
                else ""
            est = with_draft
        except Exception as exc:  # noqa: BLE001 - a drafter config transformers cannot read
            drafter = f", the drafter's not counted ({type(exc).__name__})"
    state = _state_bytes(cfg)
    split = pp * _tp_split(cfg, tp)
    nbytes = sequences * (tokens * est.bytes_per_token + state) / split
    gib = max(1, math.ceil(nbytes * KV_MARGIN / GiB))
    decoys = f" + {prompts} decoys" if cfg.decoys else ""
    per = f"; per worker of {split}" if split > 1 else ""
    state_note = f" + {state} B of recurrent state per sequence" if state else ""
    return {"gib": gib, "source": f"sized from {prompts} prompts{decoys} x max_model_len {max_len} "
                                  f"({est.bytes_per_token} B per token over {est.layers} layers{drafter}, blocks of "
                                  f"{block}{state_note}{per}: {nbytes / GiB:.3f} GiB, x{KV_MARGIN} margin, whole GiB)"}


def _tp_split(cfg: CheckConfig, tp: int) -> int:
    """How many ways TP splits a token's KV: by KV heads, unless the model
    has fewer than TP (replicated) or latent (MLA) rows, whole on every rank."""
    text = probes.model_config(cfg.model, bool(cfg.engine.get("trust_remote_code", False)))
    text = text.get("text_config") or text
    heads = text.get("num_key_value_heads") or text.get("num_attention_heads") or 0
    return tp if tp > 1 and not text.get("kv_lora_rank") and heads >= tp else 1


def _state_bytes(cfg: CheckConfig) -> int:
    """A hybrid's (or Mamba's) recurrent state per sequence, from vLLM's own
    state shapes (kvfill-record's ``state_bytes_per_sequence``); 0 for a
    model without.  vLLM's engine config is built here, this process's
    environment kept as it was (vLLM's platform sets variables there)."""
    from vllm.engine.arg_utils import EngineArgs

    from kvfill.connector.states import has_recurrent_state, state_bytes_per_sequence

    kw = {k: v for k, v in cfg.engine.items() if k != "speculative_config"}
    saved = dict(os.environ)
    try:
        if not has_recurrent_state(EngineArgs(model=cfg.model, **kw).create_model_config()):
            return 0
        return state_bytes_per_sequence(EngineArgs(model=cfg.model, **kw).create_engine_config())
    except Exception:  # noqa: BLE001 - vLLM refuses the flags: the steps report it in vLLM's words
        return 0
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


def _check_host_memory(cfg: CheckConfig, kv: dict, workers: int) -> None:
    """CheckError when this host's available memory cannot hold one engine:
    the KV space of each of its ``workers`` and the model's weights."""
    import psutil

    weights = _weight_bytes(cfg.model)
    spec = cfg.engine.get("speculative_config")
    if isinstance(spec, dict) and spec.get("model"):
        weights += _weight_bytes(spec["model"])
    need, free = kv["gib"] * GiB * workers + weights, psutil.virtual_memory().available
    if free < need:
        each = f" x {workers} workers" if workers > 1 else ""
        raise CheckError(f"this host has {free / GiB:.1f} GiB of memory available; each run's engine needs about "
                         f"{need / GiB:.1f} GiB (KV space {kv['gib']} GiB{each}, {kv['source']}; + the weights, "
                         f"{weights / GiB:.2f} GiB): expected a host with more free memory, or fewer or shorter "
                         f"prompts (a smaller --max-model-len, --output-len, --max-tokens)" + (
                             ", or a smaller VLLM_CPU_KVCACHE_SPACE" if "user" in kv["source"] else ""))


def _weight_bytes(model: str) -> int:
    """The bytes of a model's weight files: its folder's, or the hub cache's
    copy of a hub name; 0 when neither is here (vLLM then downloads them)."""
    folder = model
    if not os.path.exists(model):
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(model, local_files_only=True)
        except Exception:  # noqa: BLE001 - not in the local cache
            return 0
    if os.path.isfile(folder):
        return os.path.getsize(folder)
    files = [os.path.join(root, f) for root, _, names in os.walk(folder) for f in names]
    safetensors = [f for f in files if f.endswith(".safetensors")]  # what vLLM loads where a folder has several
    return sum(os.path.getsize(f) for f in safetensors or [f for f in files if f.endswith(WEIGHT_FILES)])
