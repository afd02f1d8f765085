"""A bank of recorded KV rows: the value source of a replay fill.

Schema (one safetensors file, ``BANK_FORMAT`` version ``BANK_VERSION``)
------------------------------------------------------------------------
* One tensor per layer, named by the layer (vLLM's attention layer name, e.g.
  ``model.layers.3.self_attn.attn``), shape ``[T, R]`` in the cache's storage
  dtype (``bfloat16``, ``float16``, ``float32``, ``uint8`` for vLLM's fp8
  caches, ...): the recorded sequences one after another, each its own
  length ``N_s`` (``T`` = their sum, a ragged bank): row ``start_s + t`` is
  the KV the model computed for token position ``t`` of sequence ``s``.
* Row order (``kv_rows.py``): an attention layer's row is canonical - K
  ``[num_kv_heads, head_size]`` then V ``[num_kv_heads, head_size_v]`` over
  all the KV heads the recording worker held; an MLA row is its latent
  ``[kv_lora_rank + rope dim]`` (one "head", ``head_size_v`` 0).  The same for
  every attention backend, cache layout and platform: staging a bank for an
  engine permutes it once into each cache's element order (vLLM CPU's K and V
  views, ``(2, B, N, H, D)``, FlashInfer NHD / HND, ``[B, H, N, 2 x head]``,
  kernel-block splits).  A layer of no known KV view (recurrent state) keeps
  its cache's own element order and replays only into the same view.
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
  ``prompts_sha256``, ...), kept as given.
* Version 3 (ragged sequences, canonical rows) replaced version 2
  (rectangular ``[S, N, R]`` in the cache's own order); older banks are
  refused with how to record them again.

Replay rule
-----------
The value of (layer, position t, element e) for a request replaying sequence
``s`` is row ``t`` of ``s`` for ``t < N_s``; past its length a sequence
wraps: row ``t mod N_s``.  A wrapped key was rotated (RoPE) for position
``t mod N_s``, not ``t``: attention over it is that of a repeated context,
not of one long one.  The recorder keeps every prompt whole by default, so a
recorded prompt never wraps.

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

import hashlib
import os
from typing import Mapping, Sequence

import numpy as np
import torch

from . import bank_file
from .bank_file import BANK_FORMAT, BANK_VERSION, BankError, dtype_name, free_bytes  # noqa: F401 (public here)
from .kv_rows import RowFormat

_PREFIX = 16  # tokens compared for every sequence before the whole comparison (BankIndex)


def sequence_key(token_ids: Sequence[int] | np.ndarray) -> str:
    """The key of a token sequence: 16 hex digits of the SHA-256 of its ids as int64."""
    ids = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64))
    return hashlib.sha256(ids.tobytes()).hexdigest()[:16]


def _lengths(num_sequences: int, lengths) -> np.ndarray:
    if isinstance(lengths, (int, np.integer)):
        return np.full(int(num_sequences), int(lengths), dtype=np.int64)
    out = np.asarray(list(lengths), dtype=np.int64).reshape(-1)
    if out.size != num_sequences or (out.size and out.min() < 1):
        raise BankError(f"sequence lengths {out.tolist()[:8]}: expected {num_sequences} ints >= 1")
    return out


def _geometry(source: str, name: str, kv) -> tuple[int, int, int]:
    g = tuple(kv) if isinstance(kv, (list, tuple)) else ()
    if len(g) != 3 or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in g) \
            or min(g[0], g[1]) < 1 or g[2] < 0:
        raise BankError(f"{source}: layer {name!r} kv is {kv!r}; expected [num_kv_heads >= 1, head_size >= 1, "
                        f"head_size_v >= 0]")
    return tuple(int(x) for x in g)


class BankIndex:
    """What choosing a block's sequence needs: each recorded sequence's
    length and token ids, read from the metadata alone (the scheduler never
    loads rows).  ``lengths``: one int (every sequence's) or one per sequence."""

    def __init__(self, num_sequences: int, lengths, sequence_tokens=()):
        self.num_sequences = int(num_sequences)
        self.lengths = _lengths(self.num_sequences, lengths)
        self.tokens = None
        if len(sequence_tokens):
            self.tokens = [np.asarray(t, dtype=np.int64).reshape(-1) for t in sequence_tokens]
            width = min(_PREFIX, int(self.lengths.max()))
            # Each sequence's first tokens, -1 past its end: compared for every sequence at once.
            self.head = np.full((self.num_sequences, width), -1, dtype=np.int64)
            for s, t in enumerate(self.tokens):
                self.head[s, :min(width, t.size)] = t[:width]

    @property
    def num_positions(self) -> int:
        """The longest sequence's length."""
        return int(self.lengths.max())

    def _agree(self, ids: np.ndarray) -> np.ndarray:
        """Per sequence: how many positions from the start its tokens equal the prompt's."""
        width = self.head.shape[1]
        m = min(ids.size, width)
        head_len = np.minimum(self.lengths, m)
        differs = (self.head[:, :m] != ids[None, :m]) | (np.arange(m)[None, :] >= head_len[:, None])
        agree = np.where(differs.any(axis=1), differs.argmax(axis=1), m)
        for s in np.flatnonzero(agree == m).tolist():  # agreeing so far: compare the whole sequence
            n = min(ids.size, int(self.lengths[s]))
            if n > m:
                d = np.flatnonzero(self.tokens[s][:n] != ids[:n])
                agree[s] = int(d[0]) if d.size else n
        return agree

    def sequences_for(self, prompt_token_ids: Sequence[int] | np.ndarray, ends) -> np.ndarray:
        """The sequence the block ending at each of ``ends`` (positions,
        exclusive, <= the prompt's length) replays: the module docstring's rule."""
        ids = np.asarray(prompt_token_ids, dtype=np.int64).reshape(-1)
        ends = np.asarray(ends, dtype=np.int64).reshape(-1)
        out = np.full(ends.size, -1, dtype=np.int64)
        if self.tokens is not None and ends.size:
            agree = self._agree(ids)
            need = np.minimum(ends[:, None], self.lengths[None, :])  # [ends, sequences]
            cover = np.where(agree[None, :] >= need, need, -1)
            best = cover.argmax(axis=1)  # the first of the largest: lowest-numbered among equals
            out = np.where(cover[np.arange(ends.size), best] > 0, best, -1)
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
    """Recorded rows per layer (see the module docstring).

    ``layers``: layer name -> ``[T, R]`` rows of ``sequence_lengths``
    sequences one after another, or ``[S, N, R]`` (S sequences of N
    positions each); host memory as given.  ``sequence_tokens``: each
    sequence's prompt token ids (optional: without them every block replays a
    sequence chosen by a hash of its prefix); ``value_dtypes``: layer -> the
    float dtype its bytes encode (``dtype_name``); ``kv``: layer -> ``(heads,
    head_size, head_size_v)`` of a canonical row; ``parts``: layer -> the
    element dims of the cache tensors it was read from; ``metadata``:
    provenance strings.
    """

    def __init__(
        self,
        layers: Mapping[str, torch.Tensor],
        *,
        sequence_lengths: Sequence[int] | None = None,
        sequence_tokens: Sequence[Sequence[int]] = (),
        value_dtypes: Mapping[str, str] | None = None,
        kv: Mapping[str, Sequence[int] | None] | None = None,
        parts: Mapping[str, Sequence[Sequence[int]]] | None = None,
        metadata: Mapping[str, str] | None = None,
        source: str = "bank",
    ):
        if not layers:
            raise BankError(f"{source}: holds no layers")
        self.source = source
        self.layers, lengths = self._packed(layers, sequence_lengths, sequence_tokens)
        self.lengths = tuple(int(n) for n in lengths)
        self.starts = tuple(int(x) for x in np.concatenate([[0], np.cumsum(self.lengths)[:-1]]))
        self.sequence_tokens = tuple(tuple(int(x) for x in t) for t in sequence_tokens)
        if self.sequence_tokens and [len(t) for t in self.sequence_tokens] != list(self.lengths):
            raise BankError(f"{source}: sequence_tokens must be {self.num_sequences} lists of the sequences' "
                            f"lengths {list(self.lengths)[:8]}, got lengths "
                            f"{[len(t) for t in self.sequence_tokens][:8]}")
        self.value_dtypes = dict(value_dtypes or {})
        self.kv = {n: _geometry(source, n, g) for n, g in (kv or {}).items() if g}
        self.parts = {n: [list(p) for p in v] for n, v in (parts or {}).items()}
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        for name, (h, d, dv) in self.kv.items():
            if name in self.layers and self.layers[name].shape[1] != h * (d + dv):
                raise BankError(f"{source}: layer {name!r} rows have {self.layers[name].shape[1]} elements, its kv "
                                f"{[h, d, dv]} names {h * (d + dv)}")

    def _packed(self, layers, sequence_lengths, sequence_tokens) -> tuple[dict, list[int]]:
        """Every layer as ``[T, R]`` and the sequences' lengths, after checking
        the layers agree on them."""
        out, shapes = {}, {}
        for name, t in layers.items():
            if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3) or min(t.shape) < 1:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise BankError(f"{self.source}: layer {name!r} is {got}; expected a tensor [rows, row] or "
                                f"[sequences, positions, row] with every dim >= 1")
            shapes[name] = tuple(t.shape[:-1])
            out[name] = t.reshape(-1, t.shape[-1]) if t.dim() == 3 else t
        if len(set(shapes.values())) != 1:
            raise BankError(f"{self.source}: layers disagree on their rows: {shapes}")
        shape = next(iter(shapes.values()))
        if len(shape) == 2:
            lengths = [shape[1]] * shape[0]
            if sequence_lengths is not None and list(sequence_lengths) != lengths:
                raise BankError(f"{self.source}: sequence_lengths {list(sequence_lengths)[:8]} disagree with "
                                f"layers of [{shape[0]}, {shape[1]}, row]")
        else:
            if sequence_lengths is None:
                sequence_lengths = [len(t) for t in sequence_tokens] or [shape[0]]
            lengths = [int(n) for n in sequence_lengths]
            if not lengths or min(lengths) < 1 or sum(lengths) != shape[0]:
                raise BankError(f"{self.source}: sequence_lengths {lengths[:8]} (sum {sum(lengths)}) must be ints "
                                f">= 1 summing to the layers' {shape[0]} rows")
        return out, lengths

    # ------------------------------------------------------------ questions
    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def num_positions(self) -> int:
        """The longest sequence's length."""
        return max(self.lengths)

    @property
    def num_rows(self) -> int:
        return sum(self.lengths)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers.values())

    @property
    def bytes_per_token(self) -> int:
        """Bank bytes per recorded token position: layers x row bytes."""
        return sum(t.shape[1] * t.element_size() for t in self.layers.values())

    @property
    def index(self) -> BankIndex:
        return BankIndex(self.num_sequences, self.lengths, self.sequence_tokens)

    def sequence_table(self) -> np.ndarray:
        """int64 ``[S, 2]``: each sequence's first row and length."""
        return np.stack([np.asarray(self.starts, np.int64), np.asarray(self.lengths, np.int64)], axis=1)

    def describe(self) -> str:
        lo, hi = min(self.lengths), max(self.lengths)
        span = f"{lo}" if lo == hi else f"{lo}-{hi}"
        return (f"{self.source}: {len(self.layers)} layers x {self.num_sequences} sequences of {span} positions "
                f"({self.num_rows} rows), {self.bytes_per_token} B per token, {self.nbytes / 2**20:.1f} MiB")

    def rows_for(self, name: str, dtype: torch.dtype, fmt: RowFormat,
                 value_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The layer's rows in the element order of a cache of ``dtype`` whose
        row is described by ``fmt`` and whose bytes encode ``value_dtype``,
        after checking they fit; BankError naming what differs."""
        rows, order = self.check_rows(name, dtype, fmt, value_dtype)
        return rows if order is None else order.to_cache(rows)

    def check_rows(self, name: str, dtype: torch.dtype, fmt: RowFormat,
                   value_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, RowFormat | None]:
        """``rows_for`` without the permutation: the stored rows and the
        format that puts them in the cache's order (None: already in it)."""
        t = self.layers.get(name)
        if t is None:
            some = sorted(self.layers)[:3]
            raise BankError(f"{self.source}: has no rows for layer {name!r} (it holds {len(self.layers)} layers, "
                            f"e.g. {some}); record the bank from the same model")
        if t.dtype != dtype:
            raise BankError(f"{self.source}: layer {name!r} was recorded as {t.dtype}, the cache holds {dtype}; "
                            f"record the bank with the same dtype and kv_cache_dtype")
        recorded = self.value_dtypes.get(name)
        if value_dtype is not None and recorded and recorded != dtype_name(value_dtype):
            raise BankError(f"{self.source}: layer {name!r} holds {recorded} values, the cache encodes "
                            f"{dtype_name(value_dtype)}; record the bank with the same kv_cache_dtype")
        cache_parts = [list(p) for p in fmt.parts]
        row = sum(int(np.prod(p)) for p in fmt.parts)
        kv = self.kv.get(name)
        if kv is not None:
            if fmt.kv is None:
                raise BankError(f"{self.source}: layer {name!r} holds K/V rows of {list(kv)} (heads, head_size, "
                                f"head_size_v); the cache's element dims {cache_parts} are no known K/V view "
                                f"(give the engine the layer's geometry: CacheGroup(kv=...))")
            if tuple(fmt.kv) != kv:
                raise BankError(f"{self.source}: layer {name!r} was recorded with {list(kv)} (heads, head_size, "
                                f"head_size_v), the cache holds {list(fmt.kv)}: another model or head layout")
            return t, (fmt if fmt.order is not None else None)
        if t.shape[1] != row:
            raise BankError(f"{self.source}: layer {name!r} rows have {t.shape[1]} elements, the cache's have {row} "
                            f"(another model or head layout?)")
        recorded_parts = self.parts.get(name)
        if recorded_parts and recorded_parts != cache_parts:
            raise BankError(f"{self.source}: layer {name!r} rows were recorded in the element order of caches with "
                            f"element dims {recorded_parts} (no known K/V view), these caches have {cache_parts}; "
                            f"record the bank on this platform and attention backend")
        return t, None

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
