"""Tiny random-weight models made locally (no hub), for the main job, serving and tests.

Few layers and a small hidden size, but full-size KV heads (8 x 128), so the
KV cache - what the connectors fill - is as large per token and layer as a
real model's.  ``make_tokenizer`` adds a word-level tokenizer (vocabulary
``w0 ... wN``), which vLLM's OpenAI server and ``vllm bench serve`` need.
"""
from __future__ import annotations

import os

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


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Make the tiny model (and its tokenizer) in a folder, once.")
    p.add_argument("path")
    p.add_argument("--hybrid", action="store_true", help="Gemma3 alternating sliding-window and full attention")
    a = p.parse_args()
    print(make_tokenizer(make_model(a.path, a.hybrid)))
