"""``python -m kvfill.record`` / ``kvfill-record``: see kvfill.record."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from kvfill.record import RecordError, record

    p = argparse.ArgumentParser(prog="kvfill-record", description="Record real KV rows of prompts into a bank "
                                "for kvfill's replay fill (fill_mode 'replay').")
    p.add_argument("--model", required=True, help="model folder or name vLLM loads")
    p.add_argument("--prompts", required=True, help="UTF-8 text file, one prompt per line (blank lines skipped), or a .jsonl file of "
                        "{\"prompt\": ...} objects (vLLM's custom dataset format; prompts with line breaks)")
    p.add_argument("--out", required=True, help="bank file to write (.safetensors), in an existing writable folder")
    p.add_argument("--positions", type=int, default=None,
                   help="the most positions recorded per prompt (default: every prompt whole, each its own "
                        "length)")
    p.add_argument("--budget-gib", type=float, default=None, help="refuse a bank larger than this (GiB > 0)")
    p.add_argument("--dtype", default="auto", help="vLLM's --dtype")
    p.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype (the bank's storage dtype)")
    p.add_argument("--block-size", type=int, default=None, help="vLLM's --block-size (the bank does not depend on it)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="vLLM's --max-model-len (default: the longest prompt + 16); give the serving run's for "
                        "bit-identical KV (vLLM CPU's attention rounding depends on it)")
    a = p.parse_args(argv)
    try:
        record(a.model, a.prompts, a.out, positions=a.positions, budget_gib=a.budget_gib, dtype=a.dtype,
               kv_cache_dtype=a.kv_cache_dtype, block_size=a.block_size, tokenizer=a.tokenizer,
               max_model_len=a.max_model_len)
    except RecordError as exc:
        print(f"kvfill-record: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the work folder is already removed
        print("kvfill-record: interrupted; nothing written", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
