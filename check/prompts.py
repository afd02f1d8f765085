"""kvfill-check's prompts as the runs read them: each prompt's text, its
token ids tokenized as kvfill-record tokenizes them (so replay finds their
rows), and its class; a tokenizer the check cannot load named with what its
folder holds."""
from __future__ import annotations

import os

from .cli import CheckConfig, CheckError


def token_ids(cfg: CheckConfig) -> tuple[object, list[str], list[list[int]], list[str] | None]:
    """The tokenizer, the prompts, their token ids read and tokenized as
    kvfill-record does (so replay finds their rows), and their classes."""
    from transformers import AutoTokenizer

    from kvfill.record.inputs import read_prompt_classes, read_prompts, unresolved

    trust = bool(cfg.engine.get("trust_remote_code", False))
    prompts = read_prompts(cfg.prompts)  # RecordError (a ValueError) naming the file and line
    classes = read_prompt_classes(cfg.prompts)  # the same, for a class that is missing or bad
    source = cfg.engine.get("tokenizer") or cfg.model
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust)
    except Exception as exc:  # OSError, the hub's errors, transformers' ValueError for a folder it cannot use
        if os.path.isdir(source):
            raise CheckError(_tokenizer_folder(cfg, source, exc)) from None
        raise CheckError(unresolved(exc, model=cfg.model, tokenizer=cfg.engine.get("tokenizer"))) from None
    ids = [list(tok(p).input_ids) for p in prompts]
    empty = [i for i, t in enumerate(ids, 1) if not t]
    if empty:
        raise CheckError(f"--prompts {cfg.prompts!r}: prompt {empty[0]} tokenizes to no tokens; expected text the "
                         f"model's tokenizer makes at least one token of")
    return tok, prompts, ids, classes


# Files a tokenizer is read from (fast, slow, tiktoken): one of them in a folder says it is meant to hold one.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "merges.txt", "spiece.model", "sentencepiece.bpe.model", "special_tokens_map.json")


def _tokenizer_folder(cfg: CheckConfig, folder: str, exc: Exception) -> str:
    """One line for a tokenizer folder transformers cannot load: it has no
    tokenizer files, or those it has fail (transformers' first line)."""
    flag = "--tokenizer" if cfg.engine.get("tokenizer") else "--model"
    detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    names = sorted(os.listdir(folder))
    found = [n for n in names if n in TOKENIZER_FILES or n.endswith(".tiktoken")]
    if not found:
        return (f"{flag} {folder!r} is a folder with no tokenizer files (it holds {', '.join(names[:6]) or 'nothing'}"
                f"{', ...' if len(names) > 6 else ''}); expected the model's tokenizer files there (tokenizer.json, "
                f"or tokenizer_config.json with its vocabulary)" + (
                    ", or --tokenizer naming a folder or hub model that has them" if flag == "--model" else ""))
    return (f"{flag} {folder!r}: transformers cannot load its tokenizer files ({', '.join(found[:4])}: "
            f"{type(exc).__name__}: {detail}); expected a tokenizer this transformers reads" + (
                ", or --tokenizer naming another" if flag == "--model" else ""))
