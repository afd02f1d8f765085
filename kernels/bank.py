"""A bank of recorded KV rows: the value source of a replay fill.

Schema (one safetensors file, ``BANK_FORMAT`` version ``BANK_VERSION``)
------------------------------------------------------------------------
* One tensor per layer, named by the layer (vLLM's attention layer name, e.g.
  ``model.layers.3.self_attn.attn``), shape ``[S, N, R]`` in the cache's
  storage dtype (``bfloat16``, ``float16``, ``float32``, ``uint8`` for vLLM's
  fp8 caches, ...): row ``[s, t]`` is the KV the model computed for token
  position ``t`` of recorded sequence ``s``, ``R`` elements in the
  element order of ``layout.py`` - the row-major index over the cache's
  element dims in logical order, independent of the physical dim order and
  strides; a layer registered as several tensors has their rows one after
  another.  vLLM's caches: ``[K/V, head, head_dim]`` for ``(2, B, N, H, D)``
  views and vLLM CPU's K and V views, ``[head, K/V + head_dim]`` for the
  ``[B, H, N, 2 * head_size]`` standard layout, ``[latent + rope]`` for MLA.
  So a bank replays into any physical order of the same logical view; rows
  of another logical view (even with the same row size, e.g. the standard
  layout vs ``(2, B, N, H, D)``) are refused by the ``parts`` check below
  rather than replayed scrambled - conservatively: vLLM CPU's K/V views
  (``[[H, D], [H, D]]``) and ``(2, B, N, H, D)`` (``[[2, H, D]]``) order the
  elements alike but are refused too.
* ``__metadata__`` (strings): ``format``, ``version``, ``num_sequences``,
  ``num_positions`` (both must equal every layer tensor's ``S`` and ``N``),
  ``sequence_tokens`` (JSON list of S lists: each sequence's first N prompt
  token ids; may be empty for a bank of no known prompts), ``layers`` (JSON: name ->
  ``{"dtype", "row", "value_dtype", "parts"}``: storage dtype, row elements,
  the float dtype the bytes encode, e.g. ``float8_e4m3fn`` for a ``uint8`` fp8
  cache, and the logical element dims of each registered tensor of the layer
  (``Registry.row_parts``: not merged by strides), e.g. ``[[8, 128], [8,
  128]]`` for vLLM CPU's K and V views - what "the element order" means for
  this bank) and provenance written by the recorder
  (``model``, ``dtype``, ``kv_cache_dtype``, ``block_size``,
  ``max_model_len``, ``vllm_version``, ``prompts_sha256``, ...), kept as given.
* Version 2 added ``sequence_tokens`` (version 1 held only a hash of each
  sequence's tokens, too little for the prefix rule below); a version-1 bank
  is refused with how to re-record it.

Replay rule
-----------
The value of (layer, position t, element e) for a request replaying sequence
``s`` is ``bank[layer][s, t mod N, e]``: positions past the recorded ``N``
wrap.  A wrapped key was rotated (RoPE) for position ``t mod N``, not ``t``:
attention over it is that of a repeated context, not of one long one; record
``N`` at least as long as the benchmark's inputs to avoid it.

Which sequence a block replays: a function of the tokens up to that block's
end, as real KV is (what makes vLLM's prefix caching correct).  For the
block of a request ending at position ``E`` (exclusive): the lowest-numbered
recorded sequence whose tokens equal the request's prompt at every position
below ``min(E, N)``; if none, ``sha256(prompt[:E]) mod S``
(``BankIndex.sequences_for``).  So two requests that share a cached block
agree on its rows, a recorded prompt replays its own sequence whatever ran
before it, and a prompt that shares a recorded prompt's beginning replays
that prompt's rows there.
"""
from __future__ import annotations

import hashlib
import os
from typing import Mapping, Sequence

import numpy as np
import torch

from . import bank_file
from .bank_file import (  # noqa: F401  (the bank's public names, importable from here)
    BANK_FORMAT, BANK_VERSION, BankError, dtype_name, free_bytes,
)


def sequence_key(token_ids: Sequence[int] | np.ndarray) -> str:
    """The key of a token sequence: 16 hex digits of the SHA-256 of its ids as int64."""
    ids = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64))
    return hashlib.sha256(ids.tobytes()).hexdigest()[:16]


class BankIndex:
    """What choosing a block's sequence needs: the bank's shape and each
    recorded sequence's first N token ids, read from the metadata alone (the
    scheduler never loads rows)."""

    def __init__(self, num_sequences: int, num_positions: int, sequence_tokens=()):
        self.num_sequences, self.num_positions = int(num_sequences), int(num_positions)
        tokens = np.asarray(sequence_tokens, dtype=np.int64)
        self.tokens = tokens.reshape(len(sequence_tokens), -1) if len(sequence_tokens) else None

    def sequences_for(self, prompt_token_ids: Sequence[int] | np.ndarray, ends) -> np.ndarray:
        """The sequence the block ending at each of ``ends`` (positions,
        exclusive, <= the prompt's length) replays: the module docstring's rule."""
        ids = np.asarray(prompt_token_ids, dtype=np.int64).reshape(-1)
        ends = np.asarray(ends, dtype=np.int64).reshape(-1)
        out = np.full(ends.size, -1, dtype=np.int64)
        if self.tokens is not None and ends.size:
            m = min(ids.size, self.num_positions)
            differs = self.tokens[:, :m] != ids[None, :m]
            # Positions each recorded sequence agrees with the prompt from the start.
            agree = np.where(differs.any(axis=1), differs.argmax(axis=1), m)
            need = np.minimum(ends, self.num_positions)
            ok = agree[None, :] >= need[:, None]  # [ends, sequences]
            out = np.where(ok.any(axis=1), ok.argmax(axis=1), -1)
        todo = np.flatnonzero(out < 0)
        if todo.size:
            # One pass of SHA-256 over the prompt, a digest at every end asked for.
            order = todo[np.argsort(ends[todo], kind="stable")]
            h, pos = hashlib.sha256(), 0
            for k in order:
                e = int(ends[k])
                h.update(np.ascontiguousarray(ids[pos:e]).tobytes())
                pos = e
                out[k] = int.from_bytes(h.copy().digest()[:8], "little") % self.num_sequences
        return out

    def sequence_for(self, prompt_token_ids: Sequence[int] | np.ndarray) -> int:
        """The sequence of a block ending at the prompt's end."""
        n = len(prompt_token_ids)
        return int(self.sequences_for(prompt_token_ids, [n])[0])

    @classmethod
    def read(cls, path: str | os.PathLike) -> "BankIndex":
        """The index of a bank file, from its metadata alone, after checking
        it against the file's tensors; BankError naming the file and key."""
        return cls(*bank_file.read_index(os.fspath(path)))


class Bank:
    """Recorded rows per layer, ``[S, N, R]`` each (see the module docstring).

    ``layers``: layer name -> tensor (host memory as given); ``sequence_tokens``:
    each sequence's first N prompt token ids (optional: without them every
    block replays a sequence chosen by a hash of its prefix);
    ``value_dtypes``: layer -> the float dtype its bytes encode (``dtype_name``);
    ``metadata``: provenance strings.
    """

    def __init__(
        self,
        layers: Mapping[str, torch.Tensor],
        *,
        sequence_tokens: Sequence[Sequence[int]] = (),
        value_dtypes: Mapping[str, str] | None = None,
        parts: Mapping[str, Sequence[Sequence[int]]] | None = None,
        metadata: Mapping[str, str] | None = None,
        source: str = "bank",
    ):
        if not layers:
            raise BankError(f"{source}: holds no layers")
        shapes = {}
        for name, t in layers.items():
            if not isinstance(t, torch.Tensor) or t.dim() != 3 or min(t.shape) < 1:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise BankError(f"{source}: layer {name!r} is {got}; expected a tensor [sequences, positions, row] "
                                f"with every dim >= 1")
            shapes[name] = tuple(t.shape[:2])
        if len(set(shapes.values())) != 1:
            raise BankError(f"{source}: layers disagree on [sequences, positions]: {shapes}")
        self.layers = dict(layers)
        self.num_sequences, self.num_positions = next(iter(shapes.values()))
        self.sequence_tokens = tuple(tuple(int(x) for x in t) for t in sequence_tokens)
        if self.sequence_tokens and (len(self.sequence_tokens) != self.num_sequences
                                     or {len(t) for t in self.sequence_tokens} != {self.num_positions}):
            raise BankError(f"{source}: sequence_tokens must be {self.num_sequences} lists of {self.num_positions} "
                            f"token ids, got {len(self.sequence_tokens)} of lengths "
                            f"{sorted({len(t) for t in self.sequence_tokens})}")
        self.value_dtypes = dict(value_dtypes or {})
        self.parts = {n: [list(p) for p in v] for n, v in (parts or {}).items()}
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        self.source = source

    # ------------------------------------------------------------ questions
    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers.values())

    @property
    def bytes_per_token(self) -> int:
        """Bank bytes per recorded token position of one sequence: layers x row bytes."""
        return sum(t.shape[2] * t.element_size() for t in self.layers.values())

    @property
    def index(self) -> BankIndex:
        return BankIndex(self.num_sequences, self.num_positions, self.sequence_tokens)

    def sequence_for(self, prompt_token_ids: Sequence[int] | np.ndarray) -> int:
        return self.index.sequence_for(prompt_token_ids)

    def describe(self) -> str:
        return (f"{self.source}: {len(self.layers)} layers x {self.num_sequences} sequences x "
                f"{self.num_positions} positions, {self.bytes_per_token} B per token, "
                f"{self.nbytes / 2**20:.1f} MiB")

    def check_layer(self, name: str, dtype: torch.dtype, row: int, value_dtype: torch.dtype | None = None,
                    parts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """The layer's rows, after checking they fit a cache of ``dtype`` whose
        layer row has ``row`` elements in ``parts`` (element shapes of its
        tensors) and whose bytes encode ``value_dtype``; BankError naming what
        differs.  A bank without recorded parts is not checked for them."""
        t = self.layers.get(name)
        if t is None:
            some = sorted(self.layers)[:3]
            raise BankError(f"{self.source}: has no rows for layer {name!r} (it holds {len(self.layers)} layers, "
                            f"e.g. {some}); record the bank from the same model")
        if t.dtype != dtype:
            raise BankError(f"{self.source}: layer {name!r} was recorded as {t.dtype}, the cache holds {dtype}; "
                            f"record the bank with the same dtype and kv_cache_dtype")
        if t.shape[2] != row:
            raise BankError(f"{self.source}: layer {name!r} rows have {t.shape[2]} elements, the cache's have {row} "
                            f"(another model or head layout?)")
        recorded = self.value_dtypes.get(name)
        if value_dtype is not None and recorded and recorded != dtype_name(value_dtype):
            raise BankError(f"{self.source}: layer {name!r} holds {recorded} values, the cache encodes "
                            f"{dtype_name(value_dtype)}; record the bank with the same kv_cache_dtype")
        recorded_parts = self.parts.get(name)
        if parts is not None and recorded_parts and recorded_parts != [list(p) for p in parts]:
            raise BankError(f"{self.source}: layer {name!r} rows were recorded from caches with element dims "
                            f"{recorded_parts}, these caches have {[list(p) for p in parts]}: another "
                            f"logical view, so possibly another element order (e.g. K and V per head vs per "
                            f"layer); record the bank on this platform and attention backend")
        return t

    def count_nonfinite(self) -> dict[str, int]:
        """Layer -> how many of its recorded values are NaN or infinite
        (decoded through the layer's value dtype; layers of raw bits are not
        counted).  A bank holding them replays them silently otherwise."""
        out = {}
        for name, t in self.layers.items():
            vdtype = self.value_dtypes.get(name) or dtype_name(t.dtype)
            target = getattr(torch, vdtype, None)
            if not isinstance(target, torch.dtype) or not target.is_floating_point:
                continue
            flat = t.reshape(-1)
            if t.dtype != target:
                if t.element_size() != torch.empty((), dtype=target, device="cpu").element_size():
                    continue
                flat = flat.view(target)
            bad = 0
            for a in range(0, flat.numel(), 1 << 24):  # bounded temporaries
                bad += int((~torch.isfinite(flat[a:a + (1 << 24)].float())).sum())
            if bad:
                out[name] = bad
        return out

    # ------------------------------------------------------------ files
    def save(self, path: str | os.PathLike) -> None:
        """Write the bank file atomically (``bank_file.save``)."""
        bank_file.save(self, os.fspath(path))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Bank":
        """Read a bank file into memory this process owns; BankError when it
        is not a well-formed bank of this format, its metadata disagrees with
        its tensors, or it is larger than the host's available memory."""
        return cls(**bank_file.load(os.fspath(path)))
