"""kvfill-check on the bench's own models: each preset makes its model and
prompts (locally, once), runs ``kvfill-check`` and publishes the report as
``bench/results/check-NAME-cpu.{json,md,png}`` (NAME: the preset and its
variant, ``result_name``), its paths relative to the project (``publish``).

    python bench/check_presets.py real     # SmolLM2-135M, real text asked to be summarised, ngram drafts
    python bench/check_presets.py moe      # tiny Mixtral: expert load vs real prefill's floor, held-out prompts
    python bench/check_presets.py hybrid   # tiny Qwen3-Next (gated delta-net + attention + MoE): the split reference
    python bench/check_presets.py spec     # tiny Llama drafting for itself (draft_model): acceptance
    python bench/check_presets.py spec --drafter eagle   # a random EAGLE head (or mtp: a tiny MiMo's MTP layer)
    python bench/check_presets.py spec --record-tp 2 -- --tensor-parallel-size 2   # bank at TP 2, runs at TP 2
    python bench/check_presets.py llama --record-tp 2      # the tiny Llama, no drafter: bank at TP 2, runs at TP 1
    python bench/check_presets.py llama --record-pp 2 -- --tensor-parallel-size 2   # bank at PP 2 (compiled), runs TP 2
    python bench/check_presets.py llama --lens 300 300 300 -- --enable-prefix-caching --decoys 256   # reused blocks
    python bench/check_presets.py sliding  # tiny Gemma3: sliding-window (256) and full attention, two KV cache groups
    python bench/check_presets.py hybrid --nested --lens 80 49 48 -- --verify   # multi-turn prompts, replay verified
    python bench/check_presets.py real --serve   # also each run served: vllm serve + vllm bench serve (check-real-serve-cpu.*)
    python bench/check_presets.py moe --held-out 16 --record 8 -- --output-len 8   # smaller; after --: kvfill-check's
    python bench/check_presets.py spec --lens 100 200 --classes d100 d200   # the figures per prompt class too

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
real prefill the drafter proposes the target's greedy tokens; ``--drafter
eagle`` a random EAGLE head, ``mtp`` a tiny MiMo-style model's own MTP layer
(``spec_models``).  ``llama``: the same tiny Llama without a drafter.
``sliding``: a tiny Gemma3 alternating sliding-window (256 tokens) and full
attention layers, float32, 300-token prompts.  ``--record-tp N`` / ``--record-pp N``
(every preset but real and moe) record the bank at that tensor or pipeline
parallel size with kvfill-record first (eager; compiled at PP > 1, which
vLLM CPU's pipeline needs) and give it to the check; ``--nested`` makes each
prompt the first words of the longest, as a multi-turn chat's turns;
``--dtype`` sets the model's dtype for the recording and every run; ``--tag``
names a variant that the flags after ``--`` make (``compiled``).  ``make
check-studies`` runs the exactness studies (eager/compiled banks, prefix
caching, sliding window, TP/PP pairings, hybrid state dtypes) as presets.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from kvfill.bench.common import without_machine_paths
from kvfill.bench.models import HYBRID_KINDS, PEAKED_STD, make_hybrid_model, make_model, make_moe_model, \
    make_tokenizer, make_topic_prompts, nested_prompts, word_prompts, write_lines

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "out")
PRESETS = ("real", "moe", "hybrid", "spec", "llama", "sliding")
RECORDED = ("hybrid", "spec", "llama", "sliding")  # --record-tp / --record-pp
INSTRUCTION = "Summarize the text above in two sentences."


def chat_prompts(model: str, lengths: list[int], path: str, classes: list[str] | None = None) -> str:
    """Real text of about ``lengths`` tokens asked to be summarised, in the
    model's chat template, as JSONL (prompts with line breaks), each with
    its ``classes`` entry as its class where given."""
    from transformers import AutoTokenizer

    from kvfill.bench.real_model import real_prompts

    tok = AutoTokenizer.from_pretrained(model)
    with open(path, "w") as f:
        for i, ids in enumerate(real_prompts(tok, lengths)):
            user = f"{tok.decode(ids).strip()}\n\n{INSTRUCTION}"
            text = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                           add_generation_prompt=True)
            f.write(json.dumps({"prompt": text, **({"class": classes[i]} if classes else {})}) + "\n")
    return path


def preset_args(a, work: str) -> list[str]:
    """The preset's model and prompts, made; its kvfill-check arguments."""
    dtype = a.dtype or ("bfloat16" if a.preset == "hybrid" else "float32")
    if a.preset == "real":
        from kvfill.bench.real_model import REAL_MODEL_PATH, make_real_model

        model = make_real_model(os.path.abspath(REAL_MODEL_PATH))
        prompts = chat_prompts(model, a.lens or list(range(300, 721, 60)), os.path.join(work, "prompts.jsonl"),
                               a.classes)
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
        drafts = ["--speculative-config", json.dumps(spec)] if a.drafter == "ngram" else []
        return ["--model", model, "--prompts", prompts, "--dtype", dtype, "--output-len", "48",
                "--max-tokens", "256", *drafts]
    if a.preset == "moe":
        model = make_tokenizer(make_moe_model(os.path.join(OUT, "tiny-mixtral"), init_std=0.1, shared=1.0))
        prompts = write_lines(os.path.join(work, "prompts.txt"), make_topic_prompts(a.held_out, a.prompt_len, 2))
        recorded = write_lines(os.path.join(work, "record-prompts.txt"), make_topic_prompts(a.record, a.prompt_len, 1))
        bank = os.path.join(work, "bank.safetensors")
        max_len = str(a.prompt_len + 64 + 16)
        rec = [sys.executable, "-m", "kvfill.record", "--model", model, "--prompts", recorded, "--out", bank,
               "--dtype", dtype, "--max-model-len", max_len, "--enforce-eager"]
        print("recording the bank over other prompts:", " ".join(rec), flush=True)
        subprocess.run(rec, check=True, stdout=subprocess.DEVNULL)
        return ["--model", model, "--prompts", prompts, "--bank", bank, "--dtype", dtype, "--output-len", "64",
                "--max-tokens", "0", "--max-model-len", max_len]
    if a.preset == "hybrid":
        model = make_tokenizer(make_hybrid_model(os.path.join(OUT, f"tiny-hybrid-{a.kind}"), a.kind))
        prompts = word_file(work, a, words(a, [150, 230, 310]))
        return ["--model", model, "--prompts", prompts, "--dtype", dtype, "--output-len", "10",
                "--max-tokens", "0", "--fills", "replay", "normal", *fixed_len(a, [310])]
    if a.preset == "sliding":
        model = make_tokenizer(make_model(os.path.join(OUT, "tiny-gemma3-hybrid"), hybrid=True))
        prompts = word_file(work, a, words(a, [300, 300]))
        return ["--model", model, "--prompts", prompts, "--dtype", dtype, "--output-len", "16",
                "--max-tokens", "0", *fixed_len(a, [300])]
    from kvfill.bench.spec_models import make_draft, make_eagle_head, make_mtp_model

    llama = make_tokenizer(make_model(os.path.join(OUT, "tiny-llama-peaked"), init_std=PEAKED_STD))
    prompts = word_file(work, a, words(a, [180, 260, 340]))
    model, spec = llama, None
    if a.preset == "llama":
        pass
    elif a.drafter == "mtp":  # the model's own MTP layer; vLLM's MiMo MTP predicts one token
        model, spec = make_mtp_model(os.path.join(OUT, "tiny-mimo-mtp")), {"method": "mtp", "num_speculative_tokens": 1}
    else:
        make = make_eagle_head if a.drafter == "eagle" else make_draft
        draft = make(llama, llama + ("-eagle" if a.drafter == "eagle" else "-draft"))
        spec = {"method": a.drafter, "model": draft, "num_speculative_tokens": 3}
    return ["--model", model, "--prompts", prompts, "--dtype", dtype, "--output-len", "24", "--max-tokens", "0",
            *(["--speculative-config", json.dumps(spec)] if spec else []), "--tokenizer", llama,
            *fixed_len(a, [340])]


def words(a, lens: list[int]) -> list[str]:
    """The tiny models' prompts: ``--lens`` (default ``lens``) random words, or with --nested the longest's first words."""
    return (nested_prompts if a.nested else word_prompts)(a.lens or lens, 1)


def word_file(work: str, a, lines: list[str]) -> str:
    """The word prompts' file: ``prompts.txt``, or with ``--classes`` JSONL
    giving each prompt its class (kvfill-check's figures per class)."""
    if not a.classes:
        return write_lines(os.path.join(work, "prompts.txt"), lines)
    return write_lines(os.path.join(work, "prompts.jsonl"),
                       [json.dumps({"prompt": text, "class": c}) for text, c in zip(lines, a.classes)])


def fixed_len(a, lens: list[int]) -> list[str]:
    """With a recording of the preset's own: one --max-model-len for it and every run (else the check's choice)."""
    return ["--max-model-len", str(max(a.lens or lens) + 128)] if a.record_tp or a.record_pp else []


def record_flags(args: list[str]) -> list[str]:
    """A preset's kvfill-check arguments as kvfill-record's: its engine flags
    and prompts, without the check's own options (``kvfill.check.cli.serve_argv``)."""
    from kvfill.check.cli import serve_argv

    prompts = args[args.index("--prompts") + 1]
    return [*serve_argv(args), "--prompts", prompts]


def record_bank(args: list[str], tp: int, pp: int, work: str) -> list[str]:
    """``--record-tp`` / ``--record-pp``: the bank recorded by kvfill-record at
    that parallel size with the preset's flags (each worker an even share of
    the cores on vLLM CPU; eager, but compiled at PP > 1: vLLM CPU's pipeline
    fails eager), the check given it with ``--bank``: replay from a bank
    recorded at another parallel size than the runs'."""
    from kvfill.check.steps import worker_cores

    bank = os.path.join(work, f"bank-tp{tp}-pp{pp}.safetensors")
    rec = [sys.executable, "-m", "kvfill.record", *record_flags(args), "--out", bank,
           "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp), *(["--enforce-eager"] * (pp == 1))]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **worker_cores(tp * pp)}
    print(f"recording the bank at TP {tp}, PP {pp}:", " ".join(rec), flush=True)
    subprocess.run(rec, check=True, stdout=subprocess.DEVNULL, env=env)
    return [*args, "--bank", bank]


def result_name(a, extra: list[str]) -> str:
    """check-NAME-cpu.*: the preset, its model's variant, the recording's and the runs' parallel sizes."""
    name = {"hybrid": f"hybrid-{a.kind}" if a.kind != "gdn" else "hybrid",
            "spec": "spec" if a.drafter == "draft_model" else f"spec-{a.drafter}"}.get(a.preset, a.preset)
    recorded = bool(a.record_tp or a.record_pp)
    for size, tag in ((a.record_tp, "rtp"), (a.record_pp, "rpp")):
        name += f"-{tag}{size}" if size else ""
    for flags, tag in ((("--tensor-parallel-size", "-tp"), "tp"), (("--pipeline-parallel-size", "-pp"), "pp")):
        words = [w for x in extra for w in (x.split("=", 1) if x.startswith(flags) and "=" in x else [x])]
        size = next((words[i + 1] for i, x in enumerate(words[:-1]) if x in flags), None)
        if size or recorded and tag == "tp":
            name += f"-{tag}{size or 1}"
    return name + (f"-{a.tag}" if a.tag else "") + "-serve" * a.serve


def publish(work: str, results: str, name: str) -> None:
    """The check's report in ``work`` as ``results/check-NAME-cpu.*``: the
    text files ``without_machine_paths``, the picture as made."""
    os.makedirs(results, exist_ok=True)
    for ext in ("json", "md", "png"):
        src, dst = os.path.join(work, f"report.{ext}"), os.path.join(results, f"check-{name}-cpu.{ext}")
        if not os.path.exists(src):
            if os.path.exists(dst):  # not made this time (no matplotlib, or real prefill failed): no stale copy
                os.unlink(dst)
        elif ext == "png":
            shutil.copyfile(src, dst)
        else:
            with open(src) as f:
                text = without_machine_paths(f.read(), work)
            with open(dst, "w") as f:
                f.write(text)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("preset", choices=PRESETS)
    p.add_argument("--lens", type=int, nargs="+", default=None, metavar="N", help="the prompts' lengths in tokens")
    p.add_argument("--classes", nargs="+", default=None, metavar="NAME",
                   help="each --lens prompt's class (kvfill-check's acceptance, EOS lengths and decode time per class)")
    p.add_argument("--held-out", type=int, default=256, help="moe: the prompts every run decodes")
    p.add_argument("--record", type=int, default=128, help="moe: the other prompts the bank is recorded over")
    p.add_argument("--prompt-len", type=int, default=256, help="moe: words (tokens) per prompt")
    p.add_argument("--kind", choices=HYBRID_KINDS, default="gdn", help="hybrid: the model's linear layers")
    p.add_argument("--drafter", choices=("ngram", "draft_model", "eagle", "mtp", "none"), default=None,
                   help="real: ngram (default) or none; spec: draft_model (default), eagle or mtp")
    p.add_argument("--record-tp", type=int, default=None, metavar="N",
                   help=f"{', '.join(RECORDED)}: record the bank at tensor parallel size N first (the runs' TP: "
                        "kvfill-check's --tensor-parallel-size after --)")
    p.add_argument("--record-pp", type=int, default=None, metavar="N",
                   help=f"{', '.join(RECORDED)}: record the bank at pipeline parallel size N first (compiled)")
    p.add_argument("--dtype", default=None, help="the model's dtype for the recording and every run (default: the "
                                                 "preset's: bfloat16 for hybrid, else float32)")
    p.add_argument("--nested", action="store_true",
                   help="each prompt the first words of the longest (multi-turn chat), for the word-prompt presets")
    p.add_argument("--serve", action="store_true",
                   help="kvfill-check --serve --concurrency 8: each run's EOS-honoured outputs served by vllm serve "
                        "and driven by vllm bench serve; the report goes to check-PRESET-serve-cpu.*")
    p.add_argument("--tag", default=None, help="appended to the report's name: check-PRESET[-...]-TAG-cpu.* (a variant "
                                               "the flags after -- make, e.g. compiled)")
    p.add_argument("--work", default=None, help="the models' prompts, bank, logs and report (default out/check-PRESET)")
    p.add_argument("--results", default=os.path.join(HERE, "results"),
                   help="where check-PRESET-cpu.{json,md,png} go (default bench/results)")
    a = p.parse_args(own)
    a.drafter = a.drafter or {"real": "ngram", "spec": "draft_model"}.get(a.preset)
    allowed = {"real": ("ngram", "none"), "spec": ("draft_model", "eagle", "mtp")}.get(a.preset, (None,))
    if a.drafter not in allowed:
        p.error(f"--drafter {a.drafter} with preset {a.preset}: expected one of {', '.join(map(str, allowed))}")
    for flag, size in (("--record-tp", a.record_tp), ("--record-pp", a.record_pp)):
        if size is not None and (a.preset not in RECORDED or size < 1):
            p.error(f"{flag} {size} with preset {a.preset}: expected N >= 1 with one of {', '.join(RECORDED)}")
    if a.classes and (a.preset == "moe" or not a.lens or len(a.classes) != len(a.lens)):
        p.error(f"--classes {' '.join(a.classes)} with preset {a.preset} and --lens {a.lens}: expected one class per "
                f"--lens prompt, with a preset other than moe")
    if a.nested and a.preset not in RECORDED:
        p.error(f"--nested with preset {a.preset}: expected one of {', '.join(RECORDED)} (word prompts)")
    name = result_name(a, extra)
    work = os.path.abspath(a.work or os.path.join(OUT, f"check-{name}"))
    os.makedirs(work, exist_ok=True)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    served = ["--serve", "--concurrency", "8", *(["--max-tokens", "64"] if a.preset != "real" else [])]
    args = preset_args(a, work)
    if a.record_tp or a.record_pp:
        args = record_bank(args, a.record_tp or 1, a.record_pp or 1, work)
    args = [*args, "--out", work, *(served if a.serve else []), *extra]
    print("kvfill-check " + " ".join(args), flush=True)
    # kvfill-check in a process of its own, as a user runs it: with --in-process its engines start there,
    # and vLLM CPU's kernel rebinding scans every module loaded (the real model's GGUF reader trips it)
    rc = subprocess.run([sys.executable, "-m", "kvfill.check", *args]).returncode
    publish(work, a.results, name)
    return rc


if __name__ == "__main__":
    sys.exit(main())
