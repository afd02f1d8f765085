"""Which recorded sequence a block replays (the rule in ``format.py``'s
docstring), from a bank's metadata alone: each sequence's length and token
ids.  The scheduler asks it for every block it grants; it never loads rows.
"""
from __future__ import annotations

import hashlib
import os
from typing import Sequence

import numpy as np

from . import files
from .format import BankError

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


class BankIndex:
    """What choosing a block's sequence needs: each recorded sequence's
    length and token ids, read from the metadata alone (the scheduler never
    loads rows).  ``lengths``: one int (every sequence's) or one per sequence."""

    def __init__(self, num_sequences: int, lengths, sequence_tokens=(), identity: str | None = None):
        self.identity = identity  # the file's (files.identity_of): what every rank must load
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

    def state_sequence(self, prompt_token_ids: Sequence[int] | np.ndarray, n: int) -> int:
        """The sequence whose recorded state is the state after the prompt's
        first ``n`` tokens: the lowest-numbered one recorded at exactly ``n``
        positions whose tokens are the prompt's; -1 if none is (a longer
        sequence sharing the prefix holds the state after more tokens)."""
        if self.tokens is None or n < 1:
            return -1
        ids = np.asarray(prompt_token_ids, dtype=np.int64).reshape(-1)
        if ids.size < n:
            return -1
        exact = np.flatnonzero((self.lengths == n) & (self._agree(ids[:n]) >= n))
        return int(exact[0]) if exact.size else -1

    def coverage(self, prompt_token_ids: Sequence[int] | np.ndarray, n: int, block_size: int) -> tuple[int, int, int]:
        """``(own, other, wrapped)``: of positions ``[0, n)`` filled in blocks
        of ``block_size`` positions, how many replay the prompt's own
        recorded rows (a sequence whose tokens are the prompt's through the
        block), another recorded text's (a sequence picked by the block's
        token hash, its tokens not the prompt's), and a sequence's rows past
        its recorded length (they wrap: row ``t mod N_s``, a repeated
        context)."""
        ids = np.asarray(prompt_token_ids, dtype=np.int64).reshape(-1)
        if n <= 0 or block_size <= 0:
            return 0, 0, 0
        ends = np.minimum(np.arange(1, -(-n // block_size) + 1, dtype=np.int64) * block_size, n)
        seqs = self.sequences_for(ids, ends)
        agree = self._agree(ids) if self.tokens is not None else None
        own = other = wrapped = 0
        lo = 0
        for end, s in zip(ends.tolist(), seqs.tolist()):
            length = int(self.lengths[s])
            wrapped += max(0, end - max(lo, length))
            inside = max(0, min(end, length) - lo)
            if agree is not None and agree[s] >= min(end, length):
                own += inside
            else:
                other += inside
            lo = end
        return own, other, wrapped

    def holds(self, prompt_token_ids: Sequence[int] | np.ndarray) -> bool:
        """Whether one recorded sequence starts with every token of the
        prompt: replay then writes the prompt's own rows in every block."""
        ids = np.asarray(prompt_token_ids, dtype=np.int64).reshape(-1)
        return self.tokens is not None and bool((self._agree(ids) >= ids.size).any())

    def sequence_for(self, prompt_token_ids: Sequence[int] | np.ndarray) -> int:
        """The sequence of a block ending at the prompt's end."""
        n = len(prompt_token_ids)
        return int(self.sequences_for(prompt_token_ids, [n])[0])

    @classmethod
    def read(cls, path: str | os.PathLike) -> "BankIndex":
        """The index of a bank file, from its metadata alone, after checking
        it against the file's tensors; BankError naming the file and key."""
        return cls(*files.read_index(os.fspath(path)))
