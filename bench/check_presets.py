"""kvfill-check on the bench's own models: each preset makes its model and
prompts (locally, once), runs ``kvfill-check`` and copies the report to
``bench/results/check-PRESET-cpu.{json,md,png}``.

    python bench/check_presets.py real     # SmolLM2-135M, real text asked to be summarised, ngram drafts
    python bench/check_presets.py moe      # tiny Mixtral: expert load vs real prefill's floor, held-out prompts
    python bench/check_presets.py hybrid   # tiny Qwen3-Next (gated delta-net + attention + MoE): the split reference
    python bench/check_presets.py spec     # tiny Llama drafting for itself (draft_model): acceptance
    python bench/check_presets.py moe --held-out 16 --record 8 -- --output-len 8   # smaller; after --: kvfill-check's

``real``: 8 chat prompts of 300-720 tokens of real English (the standard
library's documentation, ``real_model.real_prompts``) each asked to be
summarised in two sentences, in the model's chat template - so outputs end
at EOS, as a real data set's do - with vLLM's prompt-lookup drafter
(``ngram``, 3 tokens, lookup 2-5), float32.  ``moe``: the tiny Mixtral of
``models.make_moe_model`` (weights normal(0, 0.1), a shared embedding
direction) on topic prompts, decoding ``--held-out`` prompts with a bank
recorded over ``--record`` other prompts of the same generator (a held-out
prompt replays the recorded sequence its hash picks), so replay is not the
prompts' own KV and its expert load meets real prefill's floor, not zero.
``hybrid``: ``models.make_hybrid_model`` (``--kind``), bf16, where real
prefill split as the fill splits it is the reference.  ``spec``: the tiny
Llama (weights std 0.15) with its own weights as a draft model, so after
real prefill the drafter proposes the target's greedy tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from kvfill.bench.models import HYBRID_KINDS, make_hybrid_model, make_model, make_moe_model, make_tokenizer, \
    make_topic_prompts

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.abspath(os.path.join(HERE, "..", "out"))
PEAKED_STD = 0.15
PRESETS = ("real", "moe", "hybrid", "spec")
INSTRUCTION = "Summarize the text above in two sentences."


def write_lines(path: str, lines: list[str]) -> str:
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def word_prompts(lengths: list[int], seed: int) -> list[str]:
    """Prompts of ``lengths`` random words of the tiny models' tokenizer (one token each)."""
    import random

    r = random.Random(seed)
    return [" ".join(f"w{r.randrange(3, 1000)}" for _ in range(n)) for n in lengths]


def chat_prompts(model: str, lengths: list[int], path: str) -> str:
    """Real text of about ``lengths`` tokens asked to be summarised, in the
    model's chat template, as JSONL (prompts with line breaks)."""
    from transformers import AutoTokenizer

    from kvfill.bench.real_model import real_prompts

    tok = AutoTokenizer.from_pretrained(model)
    with open(path, "w") as f:
        for ids in real_prompts(tok, lengths):
            user = f"{tok.decode(ids).strip()}\n\n{INSTRUCTION}"
            text = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                           add_generation_prompt=True)
            f.write(json.dumps({"prompt": text}) + "\n")
    return path


def preset_args(a, work: str) -> list[str]:
    """The preset's model and prompts, made; its kvfill-check arguments."""
    if a.preset == "real":
        from kvfill.bench.real_model import REAL_MODEL_PATH, make_real_model

        model = make_real_model(os.path.abspath(REAL_MODEL_PATH))
        prompts = chat_prompts(model, a.lens or list(range(300, 721, 60)), os.path.join(work, "prompts.jsonl"))
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
        drafts = ["--speculative-config", json.dumps(spec)] if a.drafter == "ngram" else []
        return ["--model", model, "--prompts", prompts, "--dtype", "float32", "--output-len", "48",
                "--max-tokens", "256", *drafts]
    if a.preset == "moe":
        model = make_tokenizer(make_moe_model(os.path.join(OUT, "tiny-mixtral"), init_std=0.1, shared=1.0))
        prompts = write_lines(os.path.join(work, "prompts.txt"), make_topic_prompts(a.held_out, a.prompt_len, 2))
        recorded = write_lines(os.path.join(work, "record-prompts.txt"), make_topic_prompts(a.record, a.prompt_len, 1))
        bank = os.path.join(work, "bank.safetensors")
        max_len = str(a.prompt_len + 64 + 16)
        rec = [sys.executable, "-m", "kvfill.record", "--model", model, "--prompts", recorded, "--out", bank,
               "--dtype", "float32", "--max-model-len", max_len, "--enforce-eager"]
        print("recording the bank over other prompts:", " ".join(rec), flush=True)
        subprocess.run(rec, check=True, stdout=subprocess.DEVNULL)
        return ["--model", model, "--prompts", prompts, "--bank", bank, "--dtype", "float32", "--output-len", "64",
                "--max-tokens", "0", "--max-model-len", max_len]
    if a.preset == "hybrid":
        model = make_tokenizer(make_hybrid_model(os.path.join(OUT, f"tiny-hybrid-{a.kind}"), a.kind))
        prompts = write_lines(os.path.join(work, "prompts.txt"), word_prompts(a.lens or [150, 230, 310], 1))
        return ["--model", model, "--prompts", prompts, "--dtype", "bfloat16", "--output-len", "10",
                "--max-tokens", "0", "--fills", "replay", "normal"]
    from kvfill.bench.spec_models import make_draft

    model = make_tokenizer(make_model(os.path.join(OUT, "tiny-llama-peaked"), init_std=PEAKED_STD))
    draft = make_draft(model, model + "-draft")
    prompts = write_lines(os.path.join(work, "prompts.txt"), word_prompts(a.lens or [180, 260, 340], 1))
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    return ["--model", model, "--prompts", prompts, "--dtype", "float32", "--output-len", "24", "--max-tokens", "0",
            "--speculative-config", json.dumps(spec), "--tokenizer", model]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("preset", choices=PRESETS)
    p.add_argument("--lens", type=int, nargs="+", default=None, metavar="N", help="the prompts' lengths in tokens")
    p.add_argument("--held-out", type=int, default=256, help="moe: the prompts every run decodes")
    p.add_argument("--record", type=int, default=128, help="moe: the other prompts the bank is recorded over")
    p.add_argument("--prompt-len", type=int, default=256, help="moe: words (tokens) per prompt")
    p.add_argument("--kind", choices=HYBRID_KINDS, default="gdn", help="hybrid: the model's linear layers")
    p.add_argument("--drafter", choices=("ngram", "none"), default="ngram", help="real: vLLM's ngram drafts or none")
    p.add_argument("--work", default=None, help="the models' prompts, bank, logs and report (default out/check-PRESET)")
    p.add_argument("--results", default=os.path.join(HERE, "results"),
                   help="where check-PRESET-cpu.{json,md,png} go (default bench/results)")
    a = p.parse_args(own)
    name = a.preset if a.preset != "hybrid" or a.kind == "gdn" else f"hybrid-{a.kind}"
    work = os.path.abspath(a.work or os.path.join(OUT, f"check-{name}"))
    os.makedirs(work, exist_ok=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    args = [*preset_args(a, work), "--out", work, *extra]
    print("kvfill-check " + " ".join(args), flush=True)
    # kvfill-check in a process of its own, as a user runs it: with --in-process its engines start there,
    # and vLLM CPU's kernel rebinding scans every module loaded (the real model's GGUF reader trips it)
    rc = subprocess.run([sys.executable, "-m", "kvfill.check", *args]).returncode
    os.makedirs(a.results, exist_ok=True)
    for ext in ("json", "md", "png"):
        src, dst = os.path.join(work, f"report.{ext}"), os.path.join(a.results, f"check-{name}-cpu.{ext}")
        if os.path.exists(src):
            shutil.copyfile(src, dst)
        elif os.path.exists(dst):  # not made this time (no matplotlib, or real prefill failed): no stale copy
            os.unlink(dst)
    return rc


if __name__ == "__main__":
    sys.exit(main())
