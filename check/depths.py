"""kvfill-check along prompt depth (``--depths 1k,8k,32k``): each of the
user's own prompts cut to its first D tokens for every depth D, each depth a
prompt class, so that depth is the only thing that changes between classes.

* A depth is a token count, ``k`` meaning 1024 (``1k`` = 1024, ``300`` =
  300).  Every prompt must reach the largest depth: a shorter one is a
  CheckError naming it, never silently dropped (a class would then hold other
  prompts than the next depth's).
* A prompt is cut in its own text, at the end of its D-th token (the fast
  tokenizer's offsets), so the recording, the served data set and every run
  read real text: the cut text must tokenize to exactly the prompt's first
  tokens.  Where the last token's boundary does not (a merge across the cut),
  the cut moves back a token at a time, at most ``MAX_BACK``: the prompt is
  then a few tokens short of D, which its ``prompt_tokens`` in the report
  show.
* Classes: ``<class>.<depth>`` where the prompts file names classes (e.g.
  ``code.8k``), else the depth (``8k``).  ``compare.by_depth`` groups every
  class of one depth again, for the report's depth table and curves.
"""
from __future__ import annotations

import argparse
import re

MAX_BACK = 8  # tokens a cut may move back to find a boundary the text re-tokenizes at
_DEPTH = re.compile(r"([1-9][0-9]*)(k?)")


def parse(text: str) -> list[tuple[str, int]]:
    """``--depths``' value as ``(label, tokens)`` pairs, smallest first.
    ValueError naming the bad item and what was expected."""
    items = [s.strip() for s in str(text).split(",")]
    out: dict[int, str] = {}
    for s in items:
        m = _DEPTH.fullmatch(s.lower())
        if not m:
            raise ValueError(f"--depths {text!r}: {s!r} is not a depth; expected token counts separated by commas, "
                             f"each an int >= 1 or one with a k suffix (1024 tokens), e.g. 1k,8k,32k")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n in out:
            raise ValueError(f"--depths {text!r}: {s!r} is the same depth as {out[n]!r} ({n} tokens); expected "
                             f"each depth once")
        out[n] = s.lower()
    return [(label, n) for n, label in sorted(out.items())]


def argument(text: str) -> list[tuple[str, int]]:
    """``parse`` as argparse's ``type`` (its error exits 2 with the line)."""
    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cut_prompts(cfg, tok, texts: list[str], ids: list[list[int]], classes: list[str] | None):
    """``cut`` as the check's inputs take it: ``(texts, ids, classes,
    depth labels)``, texts and labels None without ``--depths``; a
    CheckError for what ``cut`` refuses."""
    if not cfg.depths:
        return None, ids, classes, None
    from .cli import CheckError

    try:
        return cut(tok, texts, ids, classes, cfg.depths, cfg.prompts)
    except ValueError as exc:
        raise CheckError(str(exc)) from None


def _offsets(tok, text: str) -> list[tuple[int, int]] | None:
    """Each token's (start, end) in ``text`` (special tokens (0, 0)), or None
    from a tokenizer without offsets (a slow one)."""
    try:
        return [tuple(o) for o in tok(text, return_offsets_mapping=True)["offset_mapping"]]
    except (NotImplementedError, ValueError, KeyError, TypeError):
        return None


def cut_one(tok, text: str, ids: list[int], depth: int, offsets=None) -> tuple[str, list[int]] | None:
    """``text`` cut so it tokenizes to ``ids[:n]``, n the largest count
    within ``MAX_BACK`` of ``depth`` at which that holds; None where none
    does.  ``offsets``: ``_offsets(tok, text)`` where the caller has them
    (one prompt is cut at every depth).  Without offsets the text is the
    decoded tokens (special ones left out: the tokenizer adds them again)."""
    offsets = _offsets(tok, text) if offsets is None else offsets
    for n in range(depth, max(depth - MAX_BACK, 0), -1):
        if offsets is not None and len(offsets) == len(ids):
            end = offsets[n - 1][1]
            if end == 0:  # a special token: nothing of the text yet
                continue
            piece = text[:end]
        else:
            piece = tok.decode(ids[:n], skip_special_tokens=True)
        got = list(tok(piece).input_ids)
        if got == ids[:n]:
            return piece, got
    return None


def cut(tok, texts: list[str], ids: list[list[int]], classes: list[str] | None,
        depths: list[tuple[str, int]], source: str) -> tuple[list[str], list[list[int]], list[str], list[str]]:
    """Every prompt at every depth, depth by depth: their texts, token ids,
    classes and depth labels.  ValueError for a prompt shorter than the
    largest depth, or one no cut near a depth re-tokenizes to its own
    first tokens."""
    deepest_label, deepest = depths[-1]
    short = [(i, len(t)) for i, t in enumerate(ids, 1) if len(t) < deepest]
    if short:
        i, n = short[0]
        raise ValueError(f"--depths {deepest_label}: prompt {i} of {source!r} has {n} tokens ({len(short)} of "
                         f"{len(ids)} prompts are shorter than {deepest}); expected every prompt at least as long "
                         f"as the largest depth, so each depth class holds the same prompts cut shorter")
    out_texts, out_ids, out_classes, labels = [], [], [], []
    offsets = [_offsets(tok, text) for text in texts]  # each prompt tokenized once, whatever the depths
    for label, depth in depths:
        for i, (text, t) in enumerate(zip(texts, ids)):
            got = cut_one(tok, text, t, depth, offsets[i])
            if got is None:
                raise ValueError(f"--depths {label}: prompt {i + 1} of {source!r} cut anywhere within {MAX_BACK} "
                                 f"tokens of {depth} tokenizes to other tokens than its own first ones; expected "
                                 f"text whose tokens can be cut there")
            out_texts.append(got[0])
            out_ids.append(got[1])
            out_classes.append(f"{classes[i]}.{label}" if classes else label)
            labels.append(label)
    return out_texts, out_ids, out_classes, labels
