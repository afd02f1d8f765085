"""Bank bytes per rank for real models, computed from their configs (no weights).

    python bench/bank_memory.py                    # 4 sequences x 32k positions, the table below
    python bench/bank_memory.py --sequences 8 --positions 131072

A bank row per token and attention layer is K then V over the model's KV
heads (``head_size`` each), or MLA's latent + rope row (``kvfill/bank/format.py``).
The "per rank" column is what a replaying rank loads: only what it writes
(``kvfill/bank/parts.py``, docs/replay.md):

* tensor parallel size T: its ``max(1, H / T)`` KV heads (with fewer KV heads
  than ranks, vLLM replicates a head over ``T / H`` ranks: each holds one);
  MLA's latent row is not split by heads: every rank holds it whole;
* pipeline parallel size P: its stage's layers (``ceil(L / P)`` at most);
* decode context parallel size W: the positions it holds, ``ceil(N / W)``.

The configs' few numbers are written here from the models' ``config.json``
(nothing is downloaded); the cache dtype is the model's (bf16).
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelKV:
    name: str
    layers: int           # attention layers (num_hidden_layers)
    kv_heads: int         # num_key_value_heads (1 for MLA)
    head_size: int        # K head size (MLA: kv_lora_rank + qk_rope_head_dim)
    head_size_v: int      # V head size (MLA: 0, the latent row is K and V)
    itemsize: int = 2     # bf16

    @property
    def mla(self) -> bool:
        return self.head_size_v == 0


# From each model's config.json on the Hugging Face hub.
MODELS = {
    # meta-llama/Llama-3.1-70B: num_hidden_layers 80, num_key_value_heads 8, head_dim 128
    "llama-3.1-70b": ModelKV("Llama-3.1-70B", 80, 8, 128, 128),
    # deepseek-ai/DeepSeek-V3: num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64 (MLA)
    "deepseek-v3": ModelKV("DeepSeek-V3", 61, 1, 512 + 64, 0),
    # Qwen/Qwen3-235B-A22B: num_hidden_layers 94, num_key_value_heads 4, head_dim 128
    "qwen3-235b-a22b": ModelKV("Qwen3-235B-A22B", 94, 4, 128, 128),
}

# (model, tensor parallel, pipeline parallel, decode context parallel)
CASES = [("llama-3.1-70b", 8, 1, 1), ("deepseek-v3", 8, 1, 1), ("deepseek-v3", 8, 1, 8),
         ("qwen3-235b-a22b", 4, 1, 1)]


def row_bytes(m: ModelKV, tp: int = 1) -> int:
    """Bytes of one layer's row for one token on one rank."""
    heads = m.kv_heads if m.mla else max(1, m.kv_heads // tp)
    return heads * (m.head_size + m.head_size_v) * m.itemsize


def rank_bytes(m: ModelKV, sequences: int, positions: int, tp: int = 1, pp: int = 1, dcp: int = 1) -> int:
    """Bank bytes one rank loads."""
    return sequences * math.ceil(positions / dcp) * math.ceil(m.layers / pp) * row_bytes(m, tp)


def table(sequences: int, positions: int) -> str:
    lines = ["| model | TP | PP | DCP | whole bank | per rank | per token and rank |",
             "|---|---|---|---|---|---|---|"]
    for key, tp, pp, dcp in CASES:
        m = MODELS[key]
        whole = rank_bytes(m, sequences, positions)
        mine = rank_bytes(m, sequences, positions, tp, pp, dcp)
        per_token = math.ceil(m.layers / pp) * row_bytes(m, tp)
        lines.append(f"| {m.name} | {tp} | {pp} | {dcp} | {whole / 2**30:.2f} GiB | {mine / 2**30:.2f} GiB | "
                     f"{per_token / 1024:.1f} KiB |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--positions", type=int, default=32768)
    a = p.parse_args(argv)
    if a.sequences < 1 or a.positions < 1:
        p.error(f"--sequences {a.sequences} and --positions {a.positions}: expected ints >= 1")
    print(f"bank bytes for {a.sequences} sequences x {a.positions} positions (bf16):")
    print(table(a.sequences, a.positions))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
