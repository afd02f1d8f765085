"""``--past-bank rotate`` refused before any engine starts, for a model
whose keys replay cannot turn - what the replaying worker would refuse
only at registration (``connector/rotary_source.py``), after real prefill
and a recording had run.  Read from vLLM's model config of the run:

* no rotary embedding at all (``no_rotary``): ALiBi, learned positions,
  none (Jamba, Granite-4.0-H's ``position_embedding_type: "nope"``) -
  decided as vLLM's model code decides it, since transformers fills
  ``rope_parameters`` for every config;
* dual-chunk attention (``dual_chunk_attention_config``): a key's angle is
  its chunk's, not one table row per position;
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
# Architectures whose vLLM model (vllm/model_executor/models/*.py, 0.32) never calls get_rope, so replay's
# worker finds no rotary embedding to turn keys by and refuses - after the recording and real prefill ran.
NO_ROTARY = {
    "BloomForCausalLM": "ALiBi (bloom.py)", "Step1ForCausalLM": "ALiBi (step1.py)",
    "GPT2LMHeadModel": "learned absolute positions (gpt2.py)", "OPTForCausalLM": "learned absolute positions (opt.py)",
    "JambaForCausalLM": "no position embedding in its attention (jamba.py)",
    "NemotronHForCausalLM": "no position embedding in its attention (nemotron_h.py)",
    "NemotronHPuzzleForCausalLM": "no position embedding in its attention (nemotron_h.py)",
    "MambaForCausalLM": "no attention (mamba.py)", "FalconMambaForCausalLM": "no attention (mamba.py)",
    "Mamba2ForCausalLM": "no attention (mamba2.py)",
}
# position_embedding_type values no vLLM model turns keys for (granitemoehybrid.py applies RoPE only for "rope";
# the BERT family's "absolute"; ALiBi's models)
NOT_ROTARY_TYPES = ("nope", "none", "absolute", "alibi", "learned")


def check_rotate(model_config, max_len: int, past_bank: str = "rotate") -> None:
    """CheckError naming why ``--past-bank rotate`` cannot replay this model
    (nothing to check for ``wrap``)."""
    if past_bank != "rotate":
        return
    from vllm.transformers_utils.config import iter_rope_parameters

    from kvfill.connector.rotary_source import layer_type_parameters

    hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    why = no_rotary(model_config)
    if why:
        raise CheckError(f"--past-bank rotate: {why}: its keys carry no rotary position to turn{WRAP}")
    configs = (hf, getattr(model_config, "hf_config", hf))
    chunked = next((c.dual_chunk_attention_config for c in configs if getattr(c, "dual_chunk_attention_config", None)),
                   None)
    if chunked:
        raise CheckError(f"--past-bank rotate: the model's dual_chunk_attention_config {chunked} gives a key the angle "
                         f"of its place in a chunk, not one table row per position; re-rotating it is not "
                         f"implemented{WRAP}")
    nope = [i for i, r in enumerate(getattr(hf, "no_rope_layers", None) or []) if not r]
    if nope:
        raise CheckError(f"--past-bank rotate: the model declares {len(nope)} layers without RoPE (no_rope_layers, "
                         f"first: {nope[0]}); their keys would be turned as rotary ones{WRAP}")
    params = list(iter_rope_parameters(hf))
    distinct = {repr(sorted((k, v) for k, v in p.items() if k != "partial_rotary_factor")) for p in params}
    if len(distinct) > 1 and layer_type_parameters(hf) is None:  # per layer type: each layer turned by its own
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


def no_rotary(model_config) -> str | None:
    """Why the model's attention applies no rotary embedding, as vLLM's
    model code decides it (None: it does).  transformers gives every
    config ``rope_parameters`` (Granite-4.0-H's and Jamba's too), so they
    cannot say it: the architecture does (``NO_ROTARY``), or the config
    field its model reads - ``position_embedding_type`` (Granite-4.0-H:
    "nope"), Falcon's ``alibi``, Zamba2's ``use_mem_rope``."""
    hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    configs = (hf, getattr(model_config, "hf_config", hf))
    archs = list(getattr(model_config, "architectures", None) or getattr(hf, "architectures", None) or [])
    arch = next((a for a in archs if a in NO_ROTARY), None)
    if arch:
        return f"vLLM's {arch} has {NO_ROTARY[arch]}, no rotary embedding"
    for c in configs:
        kind = getattr(c, "position_embedding_type", None)
        if isinstance(kind, str) and kind.lower() in NOT_ROTARY_TYPES:
            return f"the model's position_embedding_type is {kind!r} (vLLM applies RoPE for \"rope\" only)"
        if getattr(c, "alibi", False) is True:
            return "the model's config sets alibi: true (ALiBi attention biases, no rotary embedding)"
    if "Zamba2ForCausalLM" in archs and not getattr(hf, "use_mem_rope", False):
        return "the model's use_mem_rope is false (vLLM's Zamba2 applies RoPE only with it)"
    return None
