"""What a bank file holds and how it replays: the schema, the replay rule, the format's
name and version, and the error every bank problem raises.

A bank holds recorded KV rows: the value source of a replay fill.

Schema (one safetensors file, ``BANK_FORMAT`` version ``BANK_VERSION``)
------------------------------------------------------------------------
* One tensor per layer, named by the layer (vLLM's attention layer name, e.g.
  ``model.layers.3.self_attn.attn``), shape ``[T, R]`` in the cache's storage
  dtype (``bfloat16``, ``float16``, ``float32``, ``uint8`` for vLLM's fp8
  caches, ...): the recorded sequences one after another, each its own
  length ``N_s`` (``T`` = their sum, a ragged bank): row ``start_s + t`` is
  the KV the model computed for token position ``t`` of sequence ``s``.
* Row order (``rows.py``): an attention layer's row is canonical - K
  ``[num_kv_heads, head_size]`` then V ``[num_kv_heads, head_size_v]`` over
  all the model's KV heads (a recording under tensor parallelism merges its
  ranks' heads); an MLA row is its latent
  ``[kv_lora_rank + rope dim]`` (one "head", ``head_size_v`` 0).  The same for
  every attention backend, cache layout and platform: staging a bank for an
  engine permutes it once into each cache's element order (vLLM CPU's K and V
  views, ``(2, B, N, H, D)``, FlashInfer NHD / HND, ``[B, H, N, 2 x head]``,
  kernel-block splits).  A layer of no known KV view keeps its cache's own
  element order and replays only into the same view.
* ``__metadata__`` (strings): ``format``, ``version``, ``num_sequences``,
  ``sequence_lengths`` (JSON list of S ints >= 1, summing to every layer's
  ``T``), ``sequence_tokens`` (JSON list of S lists: each sequence's
  ``N_s`` prompt token ids; may be empty for a bank of no known prompts),
  ``layers`` (JSON: name -> ``{"dtype", "row", "value_dtype", "kv",
  "parts"}``: storage dtype, row elements, the float dtype the bytes encode
  (``float8_e4m3fn`` for a ``uint8`` fp8 cache), ``kv`` = ``[num_kv_heads,
  head_size, head_size_v]`` for a canonical row or null, and the logical
  element dims of each cache tensor the layer was recorded from
  (``Registry.row_parts``) - what the order is for a layer without ``kv``)
  and provenance written by the recorder (``model``, ``dtype``,
  ``kv_cache_dtype``, ``block_size``, ``max_model_len``, ``vllm_version``,
  ``prompts_sha256``, ``indexer_scales``: how a DeepSeek indexer row stores
  its scale, ``float32`` or ``ue8m0_x4`` (vLLM 0.34 on SM100; absent from
  banks recorded before kvfill wrote it, which hold float32), ...), kept as
  given.
* State section (hybrid models, ``state.py``): per state layer (vLLM's
  ``MambaSpec`` layers: gated delta-net, Mamba, ...) and state tensor ``i``,
  a tensor ``<layer>/state<i>`` ``[S, *full shape]`` in the state's own
  dtype: each sequence's state after all its positions, all heads and
  channels; metadata ``states`` (JSON: layer -> a list of ``{"shape",
  "dtype", "dim", "segments"}``: the full shape and how tensor parallelism
  cuts it).  A row tensor's name never holds ``/state``.
* Version 4 added the state section; version 3 (ragged sequences, canonical
  rows, no state) is still read.  Version 3 replaced version 2 (rectangular
  ``[S, N, R]`` in the cache's own order); older banks are refused with how
  to record them again.
* What one rank of a parallel engine loads of it - its KV heads, its
  pipeline stage's layers, its DCP positions - is ``parts.py``.

Replay rule
-----------
The value of (layer, position t, element e) for a request replaying sequence
``s`` is row ``t`` of ``s`` for ``t < N_s``; past its length a sequence
wraps: row ``t mod N_s``.  A wrapped key was rotated (RoPE) for position
``t mod N_s``, not ``t``: attention over it is that of a repeated context,
not of one long one.  The recorder keeps every prompt whole by default, so a
recorded prompt never wraps.  (Under DCP a rank holds only its positions and
wraps within them: ``parts.py``.)

Which sequence a block replays: a function of the tokens up to that block's
end, as real KV is (what makes vLLM's prefix caching correct).  For the
block of a request ending at position ``E`` (exclusive), a sequence
*qualifies* when its tokens equal the prompt's at every position below
``min(E, N_s)``; of those, the one covering most of ``[0, E)`` (the largest
``min(E, N_s)``), the lowest-numbered among equals; if none qualifies,
``sha256(prompt[:E]) mod S`` (``BankIndex.sequences_for``).  So two requests
that share a cached block agree on its rows, a recorded prompt replays its
own rows whatever its length and whatever ran before it, and a prompt that
shares a recorded prompt's beginning replays that prompt's rows there.
"""
from __future__ import annotations

import torch

BANK_FORMAT = "kvfill-bank"
BANK_VERSION = "4"
READ_VERSIONS = ("3", "4")  # version 3: no state section


class BankError(ValueError):
    """A bank that cannot be used: names the file or layer, what was found and what was expected."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
