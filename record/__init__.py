"""kvfill.record: record real KV once, for replay fills.

    python -m kvfill.record --model MODEL --prompts FILE --out BANK [--positions N] [--budget-gib G]
    kvfill-record ...                        (the same, installed as a console script)

Runs vLLM's engine with real prefill over the prompts (FILE: one prompt per
line) with ``KVFillConnector`` in its record role: after the forward that
completes a prompt's position ``N - 1``, the worker reads every attention
layer's rows ``[0, N)`` from the request's own blocks (``wait_for_save``) and
saves them.  The rows are assembled into one bank file (``kvfill.kernels.bank``:
safetensors, per layer ``[prompts, N, row]`` in the cache's storage dtype,
layout-independent element order, provenance in the metadata).  Replay it with
``kv_connector_extra_config: {"fill_mode": "replay", "bank": BANK}``.

The size is estimated from the model's config before vLLM starts (prompts x N x
layers x row bytes) and checked against ``--budget-gib``; the bank actually
written is checked again.  Record with tensor and decode-context parallel size
1 (whole layers on one worker); the bank then replays under any DCP size.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import tempfile
from typing import Sequence

import torch

from kvfill.kernels import Bank
from kvfill.kernels.bank import sequence_key


class RecordError(ValueError):
    """Bad input to the recorder: names the value and what was expected."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    sequences: int
    positions: int
    bytes_per_token: int  # layers x row bytes
    layers: int

    @property
    def nbytes(self) -> int:
        return self.sequences * self.positions * self.bytes_per_token

    def __str__(self) -> str:
        return (f"{self.sequences} sequences x {self.positions} positions x {self.bytes_per_token} B per token "
                f"({self.layers} attention layers) = {self.nbytes / 2**20:.1f} MiB")


_KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "fp8_ds_mla": 1}
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def estimate(model: str, sequences: int, positions: int, dtype: str = "auto", kv_cache_dtype: str = "auto"
             ) -> Estimate:
    """Bank size from the model's config.json: attention layers x K+V row bytes
    (MLA: the latent + rope row).  An estimate: the bank written is checked too."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    layers = text.num_hidden_layers
    types = getattr(text, "layer_types", None)
    if types:  # hybrid models: only attention layers hold KV rows
        layers = sum(1 for t in types if "attention" in t)
    if kv_cache_dtype in _KV_DTYPE_BYTES:
        itemsize = 1
    else:
        name = dtype if dtype != "auto" else str(getattr(text, "dtype", None) or getattr(text, "torch_dtype", "bfloat16"))
        itemsize = _DTYPE_BYTES.get(name.removeprefix("torch."), 2)
    if getattr(text, "kv_lora_rank", None):  # MLA
        row = text.kv_lora_rank + text.qk_rope_head_dim
    else:
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        row = 2 * heads * head_dim
    return Estimate(sequences, positions, layers * row * itemsize, layers)


def read_prompts(path: str) -> list[str]:
    """One prompt per non-empty line."""
    if not os.path.isfile(path):
        raise RecordError(f"--prompts {path!r} does not exist; expected a text file with one prompt per line")
    with open(path, encoding="utf-8") as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise RecordError(f"--prompts {path!r} holds no prompt; expected one prompt per line")
    return prompts


def choose_positions(token_ids: Sequence[Sequence[int]], positions: int | None) -> int:
    """N: the given positions (every prompt must have that many tokens) or the
    shortest prompt's length."""
    lengths = [len(t) for t in token_ids]
    if positions is None:
        return min(lengths)
    if positions < 1:
        raise RecordError(f"--positions {positions} is invalid; expected an int >= 1")
    short = [i + 1 for i, n in enumerate(lengths) if n < positions]
    if short:
        raise RecordError(f"--positions {positions}: prompt line(s) {short[:5]} have fewer tokens "
                          f"({[lengths[i - 1] for i in short[:5]]}); expected every prompt to have >= {positions}")
    return positions


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
    log=print,
) -> Bank:
    """Record the bank (module docstring); returns it after writing ``out``."""
    from transformers import AutoTokenizer

    prompts = read_prompts(prompts_file)
    tok = AutoTokenizer.from_pretrained(tokenizer or model)
    ids = [list(tok(p).input_ids) for p in prompts]
    n = choose_positions(ids, positions)
    unique, seen = [], set()
    for t in ids:
        key = sequence_key(t[:n])
        if key not in seen:
            seen.add(key)
            unique.append(t)
    if len(unique) < len(ids):
        log(f"{len(ids) - len(unique)} prompt(s) repeat an earlier prompt's first {n} tokens: recorded once")
    est = estimate(model, len(unique), n, dtype, kv_cache_dtype)
    log(f"bank estimate: {est}")
    budget = None if budget_gib is None else int(budget_gib * 2**30)
    if budget is not None and est.nbytes > budget:
        raise RecordError(f"the bank would take ~{est.nbytes / 2**30:.3f} GiB, over --budget-gib {budget_gib}; "
                          f"record fewer prompts or --positions")

    work = tempfile.mkdtemp(prefix="kvfill-record-", dir=os.path.dirname(os.path.abspath(out)) or ".")
    try:
        _run_vllm(model, unique, n, work, dtype, kv_cache_dtype, block_size, max_model_len, llm_kwargs or {})
        layers: dict[str, list[torch.Tensor]] = {}
        value_dtypes: dict[str, str] = {}
        parts: dict[str, list] = {}
        from safetensors import safe_open

        for t in unique:
            path = os.path.join(work, f"{sequence_key(t[:n])}.safetensors")
            if not os.path.isfile(path):
                raise RuntimeError(f"vLLM ran, but no rows were recorded for a prompt of {len(t)} tokens ({path})")
            with safe_open(path, framework="pt") as f:
                value_dtypes = json.loads(f.metadata()["value_dtypes"])
                parts = json.loads(f.metadata().get("parts", "{}"))
                for name in f.keys():
                    layers.setdefault(name, []).append(f.get_tensor(name))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    import vllm

    with open(prompts_file, "rb") as f:
        prompts_sha = hashlib.sha256(f.read()).hexdigest()
    first = next(iter(layers.values()))[0]
    meta = {
        "model": model,
        "dtype": str(first.dtype).removeprefix("torch."),
        "kv_cache_dtype": kv_cache_dtype,
        "block_size": str(block_size or "auto"),
        "max_model_len": str(max_model_len or "auto"),
        "vllm_version": getattr(vllm, "__version__", "unknown"),
        "prompts_file": os.path.basename(prompts_file),
        "prompts_sha256": prompts_sha,
        "tokenizer": tokenizer or model,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    bank = Bank({name: torch.stack(rows) for name, rows in layers.items()},
                sequence_keys=[sequence_key(t[:n]) for t in unique],
                value_dtypes={k: v for k, v in value_dtypes.items() if k in layers},
                parts={k: v for k, v in parts.items() if k in layers}, metadata=meta, source=out)
    if budget is not None and bank.nbytes > budget:
        raise RecordError(f"the recorded bank takes {bank.nbytes / 2**30:.3f} GiB, over --budget-gib {budget_gib}; "
                          f"nothing written")
    bank.save(out)
    log(f"wrote {bank.describe()}")
    return bank


def _run_vllm(model, token_ids, n, record_dir, dtype, kv_cache_dtype, block_size, max_model_len, llm_kwargs) -> None:
    """Real prefill of every prompt (one output token) with the record role on.

    ``max_model_len``: give the serving run's to get its bits exactly: vLLM
    CPU's attention rounds differently with it, so the KV of positions past
    the first block differs in the last bits from a run with another one."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(t) for t in token_ids)
    kw = dict(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        max_model_len=max_model_len or longest + 16,
        # whole prompts per step: at least max_model_len (vLLM's rule without chunked prefill)
        max_num_batched_tokens=max(max_model_len or 0, longest + 16, 2048),
        max_num_seqs=min(len(token_ids), 16),
        enable_prefix_caching=False,  # every prompt prefilled for real, in its own blocks
        # Each prompt prefilled in one step: with chunks, vLLM frees sliding-window
        # blocks behind the window between chunks, before the rows are read.
        enable_chunked_prefill=False,
        disable_log_stats=True,
        kv_transfer_config={
            "kv_connector": "KVFillConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"record_dir": record_dir, "record_positions": n},
        },
    )
    if block_size:
        kw["block_size"] = block_size
    kw.update(llm_kwargs)
    llm = LLM(**kw)
    params = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=t) for t in token_ids], params, use_tqdm=False)
    del llm
