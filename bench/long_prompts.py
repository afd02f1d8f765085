"""Long prompts of real text already on this machine, for a fidelity study
along prompt depth (1K to 32K tokens): a JSONL prompts file kvfill-check
reads (``record.inputs``), one ``{"class": KIND, "prompt": TEXT}`` a line.

    python -m kvfill.bench.long_prompts --out PATH.jsonl [--tokens 40000] [--per-kind 2] [--tokenizer MODEL ...]

Nothing is generated and nothing is fetched: every prompt is text the Python
install carries (``sysconfig.get_paths()["stdlib"]``), in three kinds, each
line's class its kind:

* ``code``: the standard library's own ``.py`` modules, whole, in sorted
  order of their paths, each after a ``# file: <path relative to the
  stdlib>`` line (test suites, codec tables - ``encodings`` - and
  ``pydoc_data`` left out);
* ``prose``: documentation - the help topics of the Python reference
  (``pydoc_data.topics``), then the modules' docstrings in the order
  ``real_model._doc_paragraphs`` gathers them (the module's, then its
  classes' with their methods', and its functions'; private names too, for
  more text) but read from the source with ``ast``, so no module is
  imported; paragraphs that are mostly not words (doctest sessions, grammar
  rules, tables) are left out;
* ``chat``: a request first (e.g. "Summarize the following document ..."),
  then a document of prose from the same sources but other documents: the
  prose documents alternate between the two kinds.  Plain text, no chat
  template: the prompts are cut in token space and models' templates differ.

Each kind's documents are split into ``--per-kind`` runs, one a prompt, so
no two prompts share a document: code into runs of consecutive files (a
package's modules stay together), prose documents dealt out in turn (each
prose and chat prompt opens with help topics, then module docstrings).  A
prompt takes its run's whole documents from the first until it is
``--tokens`` tokens long by a conservative bound of ``CHARS_PER_TOKEN``
characters a token (trained tokenizers give ~4 on this text, SmolLM2's
3.8-4.1; with the default 40000 tokens, 32768 remain up to 7.3 characters a
token) and under every ``--tokenizer`` given (its ``tokenizer.json``,
content tokens only, so a BOS the model adds only makes it longer), more
documents being added where a tokenizer counts fewer.  A run that holds too
little is refused with the tokens it reaches.  Deterministic for a given
Python install (and tokenizers).

kvfill-check cuts every prompt to its first d tokens for each depth d, so the
same documents serve every depth and depth is the only thing that changes;
a chat prompt keeps its request at every depth.  Beside ``PATH.jsonl``,
``PATH.sources.json`` (``sources_path``) names each line's kind, length in
characters and in tokens under each ``--tokenizer``, a chat line's request,
and its source files or modules in order with their character counts, so
the prompts file says where its text comes from.
"""
from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import sys
import sysconfig
import time

KINDS = ("code", "prose", "chat")
CHARS_PER_TOKEN = 6  # a conservative bound: trained tokenizers give ~4 characters a token on this text
DEFAULT_TOKENS, DEFAULT_PER_KIND = 40000, 2
# Folders of the standard library whose modules are no source of the kinds:
# test suites, installed packages, codec tables (encodings) and the help
# topics' data file (pydoc_data, read as prose instead).
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings",
                       "pydoc_data"})
CHAT_REQUESTS = (
    "Summarize the following document in a few paragraphs: what it covers, its main ideas, and what a reader "
    "new to it should watch out for.",
    "Read the following document, then list its key points as short bullet points, one for each topic it "
    "covers, in the order it covers them.",
    "Explain the following document to a programmer who has not read it: what it describes, why it matters, "
    "and one example of its use.",
)
PROSE_SHARE = 0.75  # a prose paragraph: at least this share of its characters letters or whitespace


class LongPromptsError(ValueError):
    """A request the sources cannot meet, or a bad value: names the value and what was expected."""


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


@functools.lru_cache(maxsize=None)
def stdlib_files() -> tuple[str, ...]:
    """The standard library's ``.py`` files, paths relative to it with ``/``, sorted."""
    root, files = stdlib_root(), []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith("config-")]
        rel = os.path.relpath(folder, root)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        files += [prefix + name for name in names if name.endswith(".py")]
    return tuple(sorted(files))


@functools.lru_cache(maxsize=None)
def module_source(rel: str) -> str:
    """A stdlib file's text ("" when it is not UTF-8: then no prompt holds it)."""
    try:
        with open(os.path.join(stdlib_root(), rel), encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return ""


def _prose_like(paragraph: str) -> bool:
    """Mostly words, a heading's underline (``=====``) aside."""
    body = "\n".join(line for line in paragraph.splitlines() if len(set(line.strip())) > 1)
    return bool(body.strip()) and sum(c.isalpha() or c.isspace() for c in body) >= PROSE_SHARE * len(body)


def _paragraphs(docs) -> str:
    return "\n\n".join(p for d in docs if d for p in d.split("\n\n") if p.strip() and _prose_like(p))


@functools.lru_cache(maxsize=None)
def module_docs(rel: str) -> str:
    """A module's documentation, in the order of ``real_model._doc_paragraphs``
    but read from its source: its docstring, each class's with its methods',
    each function's, in definition order, private names too (prose
    paragraphs)."""
    try:
        tree = ast.parse(module_source(rel))
    except (SyntaxError, ValueError):
        return ""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    docs = [ast.get_docstring(tree)]
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, *functions)):
            docs.append(ast.get_docstring(node))
        if isinstance(node, ast.ClassDef):
            docs += [ast.get_docstring(m) for m in node.body if isinstance(m, functions)]
    return _paragraphs(docs)


def _topics() -> dict:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a Python packaged without it: the docstrings remain
        return {}
    return topics


# A document: (name, loader of its text); loaded only when a prompt reaches it.
def code_documents() -> list:
    return [(rel, functools.partial(module_source, rel)) for rel in stdlib_files()]


def prose_documents() -> list:
    """The help topics, then the modules' docstrings."""
    topics = _topics()
    docs = [(f"pydoc_data.topics[{k!r}]", functools.partial(lambda k: _paragraphs([topics[k]]), k))
            for k in sorted(topics)]
    return docs + [(f"{rel} docstrings", functools.partial(module_docs, rel)) for rel in stdlib_files()]


def kind_documents(kind: str) -> list:
    if kind == "code":
        return code_documents()
    prose = prose_documents()
    return prose[0::2] if kind == "prose" else prose[1::2]


def load_counter(path: str):
    """``count(text)``: the content tokens (no special tokens) of the
    tokenizer in the model folder ``path`` (its tokenizer.json, or a
    tokenizer.json file itself; transformers' AutoTokenizer for a folder
    without one)."""
    file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    if os.path.isfile(file):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(file)
        return lambda text: len(tok.encode(text, add_special_tokens=False).ids)
    if not os.path.isdir(path):
        raise LongPromptsError(f"--tokenizer {path!r}: neither a model folder nor a tokenizer.json here")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.model_max_length = sys.maxsize  # counted, not fed to a model: no warning about the length
    return lambda text: len(tok.encode(text, add_special_tokens=False))


def _assemble(kind: str, index: int, run: list, tokens: int, per_kind: int, chars_per_token: float,
              counters: dict) -> dict:
    """Prompt ``index`` of ``kind``: documents of ``run`` from the first, until
    the bound and every counter give ``tokens`` tokens."""
    head = CHAT_REQUESTS[index % len(CHAT_REQUESTS)] + "\n\n" if kind == "chat" else ""
    sep = "\n" if kind == "code" else "\n\n"
    parts, sources, k = [head] if head else [], [], 0
    size = len(head)

    def add(chars: float) -> None:  # whole documents until the prompt holds ``chars`` characters
        nonlocal k, size
        while size < chars and k < len(run):
            name, load = run[k]
            k += 1
            text = load()
            if not text:
                continue
            piece = f"# file: {name}\n{text}" + ("" if text.endswith("\n") else "\n") if kind == "code" else text
            piece = piece if len(parts) <= bool(head) else sep + piece
            parts.append(piece)
            sources.append({"source": name, "chars": len(text)})
            size += len(piece)

    def refuse(reach: int, how: str) -> LongPromptsError:
        first = run[0][0] if run else "none"
        return LongPromptsError(
            f"--tokens {tokens}: the {kind} sources hold too little for {per_kind} prompts of {tokens} tokens: "
            f"prompt {index + 1} of {kind} ({len(run)} documents from {first} on, {size} characters) reaches "
            f"{reach} tokens {how}; expected --tokens <= {reach}, or a smaller --per-kind")

    add(tokens * chars_per_token)
    if size < tokens * chars_per_token:
        raise refuse(int(size / chars_per_token), f"at {chars_per_token:g} characters a token")
    while True:
        counts = {name: count("".join(parts)) for name, count in counters.items()}
        short = {name: n for name, n in counts.items() if n < tokens}
        if not short:
            break
        if k >= len(run):
            name, n = min(short.items(), key=lambda item: item[1])
            raise refuse(n, f"under the tokenizer {name}")
        n = min(short.values())
        add(size + (tokens - n) * size / max(n, 1) * 1.1 + 1000)  # the shortfall at this text's rate, and some
    return {"class": kind, "prompt": "".join(parts), "request": head.strip() or None, "sources": sources,
            "tokens": counts}


def build(tokens: int = DEFAULT_TOKENS, per_kind: int = DEFAULT_PER_KIND, tokenizers=(),
          chars_per_token: float = CHARS_PER_TOKEN, kinds=KINDS) -> list[dict]:
    """``per_kind`` prompts of each kind, each at least ``tokens`` tokens by
    the bound and under each tokenizer in ``tokenizers`` (model folders):
    dicts with "class", "prompt", "request" (chat), "sources" (name and
    characters of each document, in order) and "tokens" (per tokenizer)."""
    for flag, value in (("--tokens", tokens), ("--per-kind", per_kind)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LongPromptsError(f"{flag} {value!r}: expected an int >= 1")
    if not chars_per_token > 0:
        raise LongPromptsError(f"characters a token {chars_per_token!r}: expected a number > 0")
    counters = {path: load_counter(path) for path in tokenizers}
    prompts = []
    for kind in kinds:
        docs = kind_documents(kind)
        if len(docs) < per_kind:
            raise LongPromptsError(f"--per-kind {per_kind}: the {kind} sources hold {len(docs)} documents; "
                                   f"expected --per-kind <= {len(docs)}")
        for i in range(per_kind):  # no document in two prompts
            if kind == "code":
                run = docs[i * len(docs) // per_kind:(i + 1) * len(docs) // per_kind]
            else:
                run = docs[i::per_kind]
            prompts.append(_assemble(kind, i, run, tokens, per_kind, chars_per_token, counters))
    return prompts


def sources_path(out: str) -> str:
    return out.removesuffix(".jsonl") + ".sources.json"


def _replace(path: str, text: str) -> None:
    tmp = f"{path}.part-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write(out: str, tokens: int = DEFAULT_TOKENS, per_kind: int = DEFAULT_PER_KIND, tokenizers=(),
          chars_per_token: float = CHARS_PER_TOKEN) -> list[dict]:
    """``out`` (a ``.jsonl`` path: kvfill reads other files as one prompt a
    line) and its sidecar ``sources_path(out)``; the prompts as ``build``."""
    if not out.endswith(".jsonl"):
        raise LongPromptsError(f"--out {out!r}: expected a path ending in .jsonl (kvfill reads any other file as "
                               f"one prompt a line)")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        raise LongPromptsError(f"--out {out!r}: its folder {folder!r} does not exist; expected an existing folder")
    prompts = build(tokens, per_kind, tokenizers, chars_per_token)
    lines = "".join(json.dumps({"class": p["class"], "prompt": p["prompt"]}) + "\n" for p in prompts)
    sidecar = {
        "prompts": os.path.basename(out), "python": sys.version.split()[0], "stdlib": stdlib_root(),
        "tokens": tokens, "per_kind": per_kind, "chars_per_token": chars_per_token, "tokenizers": list(tokenizers),
        "lines": [{"line": no, "class": p["class"], "chars": len(p["prompt"]), "tokens": p["tokens"],
                   **({"request": p["request"]} if p["request"] else {}), "sources": p["sources"]}
                  for no, p in enumerate(prompts, 1)],
    }
    _replace(out, lines)
    _replace(sources_path(out), json.dumps(sidecar, indent=1) + "\n")
    return prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the JSONL prompts file to write (PATH.jsonl)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"each prompt's least length in tokens (default {DEFAULT_TOKENS}: 32768 cut from it)")
    p.add_argument("--per-kind", type=int, default=DEFAULT_PER_KIND,
                   help=f"prompts of each kind, from different documents (default {DEFAULT_PER_KIND})")
    p.add_argument("--tokenizer", nargs="+", action="extend", default=[], metavar="MODEL_FOLDER",
                   help="model folders whose tokenizers must each count --tokens tokens in every prompt")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        prompts = write(args.out, args.tokens, args.per_kind, args.tokenizer)
    except LongPromptsError as exc:
        p.exit(2, f"{p.prog}: error: {exc}\n")
    for no, prompt in enumerate(prompts, 1):
        counts = ", ".join(f"{n} tokens ({name})" for name, n in prompt["tokens"].items())
        print(f"line {no}: {prompt['class']}, {len(prompt['prompt'])} characters, {len(prompt['sources'])} "
              f"documents from {prompt['sources'][0]['source']}" + (f"; {counts}" if counts else ""))
    print(f"{args.out} ({os.path.getsize(args.out)} bytes) and {sources_path(args.out)} written in "
          f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
