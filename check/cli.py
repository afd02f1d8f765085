"""kvfill-check's command line: vLLM's engine flags (parsed as ``vllm serve``
parses them, with kvfill-record's parser) plus the check's own.

Every engine flag the user gives goes to every run's engine, and to the
recording where it records the same model the same way; the check sets the
rest (``engine_kwargs``): eager (vLLM's router hooks do not fire in a
compiled graph; ``--no-enforce-eager`` compiles and leaves expert load
unmeasured), prefix caching off, stats on (vLLM's counters and timestamps
are the measurements), one batch of every prompt, seed 0, and one
``--max-model-len`` for the recording and every run (vLLM CPU's attention
rounds differently with another).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Sequence

from vllm.engine.arg_utils import EngineArgs

from kvfill.record.cli import REFUSED as RECORD_REFUSED
from kvfill.record.cli import RecordArgumentParser, _check_engine_args, _require_model, parse
from . import replays
from .depths import argument as depths_argument
from .paths import check_file, check_out

USAGE = "kvfill-check --model MODEL --prompts FILE [--bank BANK] [--out DIR] [check options] [vLLM engine options]"
FILLS = ("replay", "normal", "constant", "zeros")
IN_TREE_CONSTANT = 0.015  # vLLM's DecodeBenchConnector's fill

# The check's engine flags against a user's: a flag here is refused, naming why.
REFUSED = {
    "kv_transfer_config": "the check sets each run's KV connector itself (none for real prefill, KVFillConnector "
                          "for each fill)",
    "kv_offloading_size": "KV offloading is a KV connector of its own, in the place each run's fill takes",
    "disable_log_stats": "vLLM's stats are what the check reads (speculative-decoding counters, per-token times)",
}
# kvfill-record's refusals that hold for the check's runs too (the check tokenizes the prompts itself with
# transformers at the default revision; every run generates); the others only where the check records.
RECORDING_ALWAYS = ("tokenizer_mode", "revision", "tokenizer_revision", "runner", "convert")
# Recording prefills each prompt whole in one step: these go to the runs, not to the recording.
RUN_ONLY = ("enable_prefix_caching", "enable_chunked_prefill", "max_num_batched_tokens",
            "long_prefill_token_threshold", "max_num_scheduled_tokens", "max_num_seqs")


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here (the runner and the refusals ask)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class CheckError(ValueError):
    """Bad input to kvfill-check: printed as one line, exit 2, nothing run."""


@dataclasses.dataclass
class CheckConfig:
    """What kvfill-check runs: the parsed command line."""
    model: str
    prompts: str
    out: str
    bank: str | None
    fills: list[str]
    output_len: int
    max_tokens: int
    temperature: float
    normal: tuple[float, float] | None
    constant: float
    split: str
    run_timeout: float
    engine: dict  # the engine flags given, by LLM(**kwargs) name
    argv: list[str]
    in_process: bool = False
    serve: bool = False
    concurrency: int | None = None
    decoys: int = 0
    verify: bool = False
    time_passes: int = 3
    time_by_class: str = "on"
    bank_placement: str = "auto"
    past_bank: str = "wrap"
    also_replay: dict = dataclasses.field(default_factory=dict)  # --also-replay: run -> its settings (replays.py)
    depths: list[tuple[str, int]] | None = None  # --depths: (label, tokens), smallest first (depths.parse)


def build_parser() -> RecordArgumentParser:
    p = RecordArgumentParser(
        prog="kvfill-check", usage=USAGE, allow_abbrev=False,  # --serve hands the flags as typed to vllm serve
        description="Is a synthetic KV fill good enough for your decode benchmark, or do you need replay? Runs your "
                    "model on your prompts with real prefill, replay and the synthetic fills (one vLLM engine each, "
                    "your engine flags) and reports each fill against real prefill: tokens, EOS lengths, "
                    "speculative acceptance, MoE expert load, decode time.")
    own = p.add_argument_group("kvfill-check", "--model (required) is vLLM's, listed under ModelConfig.")
    own.add_argument("--prompts", required=True,
                     help="the prompts, as kvfill-record reads them: a text file of one prompt per line, or .jsonl "
                          "of {\"prompt\": ...}")
    own.add_argument("--bank", default=None,
                     help="a bank to replay (kvfill-record's); default: record one over --prompts into --out with "
                          "the same engine flags")
    own.add_argument("--out", default="kvfill-check", help="folder for report.json, report.md, report.png, the "
                                                           "runs' logs and a recorded bank (default %(default)s)")
    own.add_argument("--fills", nargs="+", choices=FILLS, default=list(FILLS),
                     help="the fills compared with real prefill (default: all; zeros is the in-tree connector's "
                          "fill_mean 0)")
    own.add_argument("--output-len", type=int, default=32,
                     help="greedy tokens per prompt compared token by token, EOS ignored (default %(default)s)")
    own.add_argument("--max-tokens", type=int, default=256,
                     help="the EOS-honoured run: at most this many tokens per prompt (default %(default)s; 0: no "
                          "such run)")
    own.add_argument("--temperature", type=float, default=0.0,
                     help="the EOS-honoured run's temperature (default %(default)s: greedy, so every fill's lengths "
                          "compare exactly); above 0 each prompt samples with its own seed, the same in every run")
    own.add_argument("--normal", nargs=2, type=float, default=None, metavar=("MEAN", "STD"),
                     help="the normal fill's mean and std (default: the bank's own KV mean and std)")
    own.add_argument("--constant", type=float, default=IN_TREE_CONSTANT,
                     help="the constant fill's value (default %(default)s, the in-tree connector's)")
    own.add_argument("--split-reference", choices=("auto", "on", "off"), default="auto",
                     help="also run real prefill split where a fill splits it (each prompt's last token in a step of "
                          "its own); auto: on a model with recurrent state, where unsplit prefill is no fill's "
                          "reference")
    own.add_argument("--run-timeout", type=float, default=3600, metavar="SECONDS",
                     help="a run (or the recording) still going after this is stopped and reported as failed")
    own.add_argument("--time-passes", type=int, default=3, metavar="N",
                     help="decode time: each fill's run times N passes of its fill alternating with N of real "
                          "prefill in the same engine, real prefill's run 2N of its own (default %(default)s; the "
                          "ratio's interval comes from the passes and their steps; 0: time not measured)")
    own.add_argument("--time-by-class", choices=("on", "off"), default="on",
                     help="with prompt classes, also time each class's prompts apart (2N + 2 more passes per class "
                          "and run); off: only the whole run's, each class's decode time not measured")
    own.add_argument("--in-process", action="store_true",
                     help="every step in this process, one engine after another: saves each step's start (vLLM's "
                          "import, seconds); but --run-timeout is not enforced, vLLM's output goes to this terminal, "
                          "and a step that kills the process (not an exception) ends the check")
    own.add_argument("--serve", action="store_true",
                     help="the EOS-honoured run through `vllm serve` (127.0.0.1, these engine flags, the run's fill) "
                          "driven by `vllm bench serve` over the prompts, instead of in the engine: also reports "
                          "request throughput, TPOT and the texts served")
    own.add_argument("--concurrency", type=int, default=None,
                     help="--serve: the client's --max-concurrency (default: every prompt at once)")
    own.add_argument("--decoys", type=int, default=0, metavar="K",
                     help="with --enable-prefix-caching: before the prompts, every run generates a token from an "
                          "unrecorded decoy per prompt sharing its first K tokens, so the prompts reuse cached blocks "
                          "(and states) another request filled - as served requests sharing a system prompt do")
    own.add_argument("--verify", action="store_true",
                     help="replay reads back every row and state page it writes and fails the run on a mismatch "
                          "(the connector's verify: raise; slower)")
    own.add_argument("--bank-placement", choices=("auto", "device", "host"), default="auto",
                     help="where replay keeps the bank's rows (the connector's bank_placement): on the caches' "
                          "device, in host memory streamed per step, or auto (the device where it fits)")
    own.add_argument("--past-bank", choices=("wrap", "rotate"), default="wrap",
                     help="what replay writes past a recorded sequence's end (the connector's past_bank): the "
                          "sequence again from its start as recorded, or with its keys re-rotated to their true "
                          "positions")
    own.add_argument("--also-replay", nargs="+", default=None, metavar="NAME:KEY=VALUE,...",
                     help="replay again beside replay with its own bank, bank_placement or past_bank, each run "
                          "judged against the same real prefill, e.g. replay-half:bank=half.safetensors,"
                          "past_bank=rotate (check/replays.py)")
    own.add_argument("--depths", default=None, metavar="D,D,...", type=depths_argument,
                     help="cut each prompt to its first D tokens for each depth D (an int, k = 1024: e.g. 1k,8k,32k), "
                          "each depth a prompt class (with the file's classes: CLASS.D); every prompt must reach the "
                          "largest depth")
    own.add_argument("--config", default=None, help="a YAML file of vLLM engine flags (as `vllm serve --config`)")
    EngineArgs.add_cli_args(p)
    _require_model(p)
    return p


def check_config(argv: Sequence[str] | None = None) -> CheckConfig:
    """The parsed command line; CheckError for a value the check cannot run
    with, before any engine starts (argparse's own errors exit 2)."""
    p = build_parser()
    args, given = parse(p, argv)
    flags = {a.dest: a.option_strings[0] for a in p._actions if a.option_strings}
    for dest, why in REFUSED.items():
        if dest in given:
            raise CheckError(f"{flags[dest]} {p.typed.get(dest, getattr(args, dest))}: {why}")
    for name, value, low in (("--output-len", args.output_len, 1), ("--max-tokens", args.max_tokens, 0)):
        if value < low:
            raise CheckError(f"{name} {value}: expected an int >= {low}")
    if args.time_passes < 0:
        raise CheckError(f"--time-passes {args.time_passes}: expected an int >= 0 (0: decode time not measured)")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise CheckError(f"--temperature {args.temperature}: expected a finite number >= 0")
    found = [f"{flags[r.dest]} {p.typed.get(r.dest, getattr(args, r.dest))}: {r.reason}" + (
        "" if r.dest in RECORDING_ALWAYS else " (without --bank the check records its own)")
        # max_model_len: the check's inputs hold it against the prompts and the model (inputs.prepare)
        for r in RECORD_REFUSED if r.dest in given and r.dest not in REFUSED and r.dest not in RUN_ONLY
        and r.dest != "max_model_len" and (args.bank is None or r.dest in RECORDING_ALWAYS)
        and r.applies(getattr(args, r.dest))]
    if found:
        raise CheckError("kvfill-check cannot honour these vLLM flags:\n  " + "\n  ".join(found))
    _check_config_file(p, argv)
    check_out(args.out)
    if args.normal is not None and not (math.isfinite(args.normal[0]) and 0 < args.normal[1] < math.inf):
        raise CheckError(f"--normal {args.normal[0]} {args.normal[1]}: expected a finite mean and a finite std > 0")
    if not math.isfinite(args.constant):
        raise CheckError(f"--constant {args.constant}: expected a finite number (the value every row is filled with)")
    spec = args.speculative_config if "speculative_config" in given else None
    if args.in_process and isinstance(spec, dict) and spec.get("method") == "ngram" and on_cpu():
        raise CheckError("--in-process with ngram drafts on vLLM CPU: each engine's start rebinds Triton kernels by "
                         "scanning every loaded module, and fails on the one numba's ngram proposer loads "
                         "(llvmlite's library wrapper) - every engine after the first would fail; drop --in-process")
    if args.serve and args.max_tokens < 1:
        raise CheckError(f"--serve with --max-tokens {args.max_tokens}: the served run is the EOS-honoured one; "
                         f"expected --max-tokens >= 1")
    if args.serve and args.temperature > 0:
        raise CheckError(f"--serve with --temperature {args.temperature}: vllm bench serve sends no seed per request, "
                         f"so served lengths would move with batching, not with the fill; expected the default "
                         f"greedy run (--temperature 0) with --serve")
    if args.serve:
        import importlib.util

        if importlib.util.find_spec("pandas") is None:
            raise CheckError("--serve: vLLM's client reads the prompts (its custom data set) with pandas, which is "
                             "not installed; pip install pandas (or kvfill[bench])")
    if args.concurrency is not None and (args.concurrency < 1 or not args.serve):
        raise CheckError(f"--concurrency {args.concurrency}: expected an int >= 1, with --serve")
    if args.decoys and (args.decoys < 1 or not args.enable_prefix_caching):
        raise CheckError(f"--decoys {args.decoys}: expected an int >= 1, with --enable-prefix-caching (without it "
                         f"no block is reused)")
    if not args.run_timeout > 0:
        raise CheckError(f"--run-timeout {args.run_timeout}: expected seconds > 0")
    also = replays.parse(args.also_replay)
    for run, settings in also.items():
        if "bank" in settings:
            check_file(f"--also-replay {run}: bank", settings["bank"], "a bank file kvfill-record wrote")
    if args.bank is not None:
        check_file("--bank", args.bank, "a bank file kvfill-record wrote (its --out), or no --bank (the check "
                                         "records one)")
    check_file("--prompts", args.prompts, "a text or .jsonl file of prompts")
    try:
        _check_engine_args(args)
    except ValueError as exc:  # RecordError: vLLM rejected the flags
        raise CheckError(str(exc)) from None
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    engine = {name: getattr(args, name) for name in sorted(given & fields) if name != "model"}
    return CheckConfig(model=args.model, prompts=args.prompts, out=args.out, bank=args.bank,
                       fills=list(dict.fromkeys(args.fills)), output_len=args.output_len, max_tokens=args.max_tokens,
                       temperature=args.temperature, normal=tuple(args.normal) if args.normal else None,
                       constant=args.constant, split=args.split_reference, run_timeout=args.run_timeout,
                       engine=engine, argv=list(argv) if argv is not None else [], in_process=args.in_process,
                       serve=args.serve, concurrency=args.concurrency, decoys=args.decoys, verify=args.verify,
                       time_passes=args.time_passes, time_by_class=args.time_by_class,
                       bank_placement=args.bank_placement, past_bank=args.past_bank, depths=args.depths,
                       also_replay=also)


def own_actions(p: RecordArgumentParser) -> list:
    """The check's own options (not vLLM's), but ``--config``, which is vLLM's too."""
    group = next(g for g in p._action_groups if g.title == "kvfill-check")
    return [a for a in group._group_actions if a.dest != "config"]


def _check_config_file(p: RecordArgumentParser, argv: Sequence[str] | None) -> None:
    """``--config FILE`` holds vLLM engine flags (``vllm serve --config``,
    which ``--serve`` hands it to): a key of the check's own would be read
    here and refused by ``vllm serve``."""
    import sys

    import yaml

    from kvfill.record.cli import _split_config

    argv = _split_config(list(sys.argv[1:] if argv is None else argv))
    own = {a.dest for a in own_actions(p)}
    for i, token in enumerate(argv[:-1]):
        if token == "--config":
            with open(argv[i + 1]) as f:  # vLLM's parser read it already: it exists and is YAML
                keys = list(yaml.safe_load(f) or {})
            mine = [k for k in keys if str(k).replace("-", "_") in own]
            if mine:
                raise CheckError(f"--config {argv[i + 1]!r}: {', '.join(map(str, mine))} - kvfill-check's own "
                                 f"option(s), not vLLM engine flags; expected them on the command line")


def serve_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` without the check's own options and their values: the engine
    flags as the user typed them, for ``vllm serve`` (``--config`` is
    vLLM's too, and stays)."""
    from kvfill.record.cli import _split_config

    argv = _split_config(list(argv))  # vLLM reads --config FILE, not --config=FILE
    p = build_parser()
    own = {s: a for a in own_actions(p) for s in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        action = own.get(token.split("=", 1)[0].replace("_", "-")) if token.startswith("--") else None
        i += 1
        if action is None:
            out.append(token)
        elif "=" not in token and action.nargs != 0:
            if isinstance(action.nargs, int) or action.nargs is None:
                i += action.nargs or 1
            else:  # nargs "+": the values up to the next option
                while i < len(argv) and not argv[i].startswith("-"):
                    i += 1
    return out


def engine_kwargs(cfg: CheckConfig, prompts: int, max_model_len: int) -> dict:
    """Every run's ``LLM(**kwargs)``: the check's settings, the user's flags over them."""
    return {"model": cfg.model, **eager(cfg), "enable_prefix_caching": False, "seed": 0, "max_num_seqs": prompts,
            "max_model_len": max_model_len, **cfg.engine, "disable_log_stats": False}


def eager(cfg: CheckConfig) -> dict:
    """Eager unless the user chose a mode (--enforce-eager, -O, --compilation-config), or pipeline
    parallelism on vLLM CPU (whose PP fails eager; other platforms run it eager)."""
    chosen = {"enforce_eager", "compilation_config"} & set(cfg.engine)
    cpu_pp = int(cfg.engine.get("pipeline_parallel_size") or 1) > 1 and on_cpu()
    return {} if chosen or cpu_pp else {"enforce_eager": True}


def record_call(cfg: CheckConfig, bank: str, max_model_len: int) -> dict:
    """kvfill's ``record()`` arguments: the runs' engine flags but those that
    batch prefill differently (the recorder prefills each prompt whole)."""
    from kvfill.record.cli import NAMED

    llm = {**eager(cfg), **{k: v for k, v in cfg.engine.items() if k not in RUN_ONLY}}
    named = {k: llm.pop(k) for k in NAMED if k in llm}
    named["max_model_len"] = max_model_len
    return dict(model=cfg.model, prompts_file=cfg.prompts, out=bank, **named, llm_kwargs=llm)
