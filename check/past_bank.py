"""``--past-bank rotate`` refused before any engine starts, for a model
whose keys replay cannot turn - what the replaying worker would refuse
only at registration (``connector/rotary_source.py``), after real prefill
and a recording had run.  Read from vLLM's model config of the run:

* layers declared without RoPE (``no_rope_layers``: Llama 4, SmolLM3): keys
  of the same geometry as rotary ones, which the caches cannot tell apart;
* more than one rotary embedding (per-layer-type parameters, Gemma 3's
  local and global bases): which layer uses which is not known there;
* M-RoPE (several positions per token);
* a ``max_model_len`` past the rotary table (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``
  lets vLLM start so): a key there has no angle to be turned to.
"""
from __future__ import annotations

from .cli import CheckError

WRAP = "; use --past-bank wrap"
# rope types whose cos/sin table vLLM extends to max_position_embeddings x factor
EXTENDED = ("linear", "dynamic", "yarn", "deepseek_yarn")


def check_rotate(model_config, max_len: int, past_bank: str = "rotate") -> None:
    """CheckError naming why ``--past-bank rotate`` cannot replay this model
    (nothing to check for ``wrap``)."""
    if past_bank != "rotate":
        return
    from vllm.transformers_utils.config import iter_rope_parameters

    hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    nope = [i for i, r in enumerate(getattr(hf, "no_rope_layers", None) or []) if not r]
    if nope:
        raise CheckError(f"--past-bank rotate: the model declares {len(nope)} layers without RoPE (no_rope_layers, "
                         f"first: {nope[0]}); their keys would be turned as rotary ones{WRAP}")
    params = list(iter_rope_parameters(hf))
    distinct = {repr(sorted((k, v) for k, v in p.items() if k != "partial_rotary_factor")) for p in params}
    if len(distinct) > 1:
        raise CheckError(f"--past-bank rotate: the model has {len(distinct)} different rotary embeddings (rope "
                         f"parameters per layer type); which layer uses which is not known to replay{WRAP}")
    if any(p.get("mrope_section") or p.get("rope_type") == "mrope" for p in params):
        raise CheckError(f"--past-bank rotate: the model's M-RoPE gives a token several positions; re-rotating it "
                         f"is not implemented{WRAP}")
    positions = getattr(hf, "max_position_embeddings", None)
    if not positions or max_len <= positions:
        return
    factor = max([float(p.get("factor") or 1.0) for p in params if p.get("rope_type") in EXTENDED] or [1.0])
    if max_len > positions * factor:
        raise CheckError(f"--past-bank rotate: the runs' max_model_len {max_len} is past the model's rotary table "
                         f"({int(positions * factor)} positions): a key there has no angle to be turned to; expected "
                         f"--max-model-len {int(positions * factor)} or less{WRAP}")
