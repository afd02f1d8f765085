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
  ``num_positions``, ``sequence_keys`` (JSON list: the key of each sequence's
  first N prompt tokens, ``sequence_key``), ``layers`` (JSON: name ->
  ``{"dtype", "row", "value_dtype", "parts"}``: storage dtype, row elements,
  the float dtype the bytes encode, e.g. ``float8_e4m3fn`` for a ``uint8`` fp8
  cache, and the logical element dims of each registered tensor of the layer
  (``Registry.row_parts``: not merged by strides), e.g. ``[[8, 128], [8,
  128]]`` for vLLM CPU's K and V views - what "the element order" means for
  this bank) and provenance written by the recorder
  (``model``, ``dtype``, ``kv_cache_dtype``, ``block_size``,
  ``vllm_version``, ``prompts_sha256``, ...), kept as given.

Replay rule
-----------
The value of (layer, position t, element e) for a request replaying sequence
``s`` is ``bank[layer][s, t mod N, e]``: positions past the recorded ``N``
wrap.  A wrapped key was rotated (RoPE) for position ``t mod N``, not ``t``:
attention over it is that of a repeated context, not of one long one; record
``N`` at least as long as the benchmark's inputs to avoid it.  The sequence of
a request is ``Bank.sequence_for(prompt)``: the recorded sequence whose first
``N`` prompt tokens equal the request's, else a hash of the prompt modulo
``S`` - the same prompt always replays the same sequence.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

BANK_FORMAT = "kvfill-bank"
BANK_VERSION = "1"
_RESERVED_META = ("format", "version", "num_sequences", "num_positions", "sequence_keys", "layers")


class BankError(ValueError):
    """A bank that cannot be used: names the file or layer, what was found and what was expected."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sequence_key(token_ids: Sequence[int] | np.ndarray) -> str:
    """The key of a token sequence: 16 hex digits of the SHA-256 of its ids as int64."""
    ids = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64))
    return hashlib.sha256(ids.tobytes()).hexdigest()[:16]


@dataclass(frozen=True)
class BankIndex:
    """What choosing a request's sequence needs: the bank's shape and sequence
    keys, read from the metadata alone (the scheduler never loads rows)."""

    num_sequences: int
    num_positions: int
    sequence_keys: tuple[str, ...] = ()

    def sequence_for(self, prompt_token_ids: Sequence[int] | np.ndarray) -> int:
        """The sequence a request with this prompt replays (module docstring)."""
        ids = np.asarray(prompt_token_ids, dtype=np.int64)
        if ids.size >= self.num_positions and self.sequence_keys:
            key = sequence_key(ids[: self.num_positions])
            if key in self.sequence_keys:
                return self.sequence_keys.index(key)
        digest = hashlib.sha256(np.ascontiguousarray(ids).tobytes()).digest()
        return int.from_bytes(digest[:8], "little") % self.num_sequences

    @classmethod
    def read(cls, path: str | os.PathLike) -> "BankIndex":
        """The index of a bank file, from its metadata alone."""
        meta = _read_metadata(os.fspath(path))
        return cls(int(meta["num_sequences"]), int(meta["num_positions"]),
                   tuple(json.loads(meta.get("sequence_keys", "[]"))))


class Bank:
    """Recorded rows per layer, ``[S, N, R]`` each (see the module docstring).

    ``layers``: layer name -> tensor (host memory as given); ``sequence_keys``:
    ``sequence_key`` of each sequence's first N prompt tokens (optional);
    ``value_dtypes``: layer -> the float dtype its bytes encode (``dtype_name``);
    ``metadata``: provenance strings.
    """

    def __init__(
        self,
        layers: Mapping[str, torch.Tensor],
        *,
        sequence_keys: Sequence[str] = (),
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
        self.sequence_keys = tuple(sequence_keys)
        if self.sequence_keys and len(self.sequence_keys) != self.num_sequences:
            raise BankError(f"{source}: {len(self.sequence_keys)} sequence keys for {self.num_sequences} sequences")
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
        return BankIndex(self.num_sequences, self.num_positions, self.sequence_keys)

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

    # ------------------------------------------------------------ files
    def save(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        meta = dict(self.metadata)
        meta.update(
            format=BANK_FORMAT,
            version=BANK_VERSION,
            num_sequences=str(self.num_sequences),
            num_positions=str(self.num_positions),
            sequence_keys=json.dumps(list(self.sequence_keys)),
            layers=json.dumps({
                n: {"dtype": dtype_name(t.dtype), "row": t.shape[2],
                    "value_dtype": self.value_dtypes.get(n, ""), "parts": self.parts.get(n, [])}
                for n, t in self.layers.items()
            }),
        )
        save_file({n: t.contiguous() for n, t in self.layers.items()}, os.fspath(path), metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Bank":
        """Read a bank file into host memory; BankError when it is not a bank
        of this format or larger than the host's available memory."""
        from safetensors import safe_open

        path = os.fspath(path)
        meta = _read_metadata(path)
        size, free = os.path.getsize(path), free_bytes(torch.device("cpu"))
        if free is not None and size > free:
            raise BankError(f"{path}: {size / 2**30:.2f} GiB does not fit the host's {free / 2**30:.2f} GiB "
                            f"available memory")
        with safe_open(path, framework="pt", device="cpu") as f:
            layers = {n: f.get_tensor(n) for n in f.keys()}
        info = json.loads(meta.get("layers", "{}"))
        return cls(
            layers,
            sequence_keys=json.loads(meta.get("sequence_keys", "[]")),
            value_dtypes={n: v.get("value_dtype", "") for n, v in info.items()},
            parts={n: v["parts"] for n, v in info.items() if v.get("parts")},
            metadata={k: v for k, v in meta.items() if k not in _RESERVED_META},
            source=path,
        )


def _read_metadata(path: str) -> dict[str, str]:
    """A bank file's ``__metadata__`` (no rows read); BankError for anything else."""
    if not os.path.isfile(path):
        raise BankError(f"bank {path!r} does not exist; record one with `python -m kvfill.record`")
    from safetensors import safe_open
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = dict(f.metadata() or {})
    except Exception as exc:  # safetensors raises its own error types for a bad file
        raise BankError(f"{path}: cannot be read as a safetensors file: {exc}") from None
    if meta.get("format") != BANK_FORMAT:
        raise BankError(f"{path}: not a kvfill bank (metadata format {meta.get('format')!r}, "
                        f"expected {BANK_FORMAT!r})")
    if meta.get("version") != BANK_VERSION:
        raise BankError(f"{path}: bank version {meta.get('version')!r}; this kvfill reads version {BANK_VERSION!r}")
    return meta


def free_bytes(device: torch.device) -> int | None:
    """Memory free for a bank on ``device``: the GPU's free memory, or the
    host's MemAvailable; None when unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
