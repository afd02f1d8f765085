"""kvfill-record's command line: vLLM's own engine flags plus kvfill's.

The parser is built the way ``vllm serve`` builds its engine flags
(``EngineArgs.add_cli_args`` on a ``FlexibleArgumentParser``, with ``--config
FILE.yaml``, ``--json-arg.key value`` and ``-O3``), so a serving run's flags
record the same model the same way.  kvfill adds ``--prompts``, ``--out``,
``--positions``, ``--budget-gib`` and ``--node-wait``; ``--model`` is vLLM's, made required.

The engine flags the user gave (on the command line or in ``--config``) go to
``record()``: ``dtype``, ``kv_cache_dtype``, ``block_size``, ``tokenizer`` and
``max_model_len`` by name (the recorder reads them itself), every other one in
``llm_kwargs`` under its ``LLM(**kwargs)`` field name, where it overrides the
recorder's own setting.  Flags that recording cannot honour are refused here,
before vLLM starts (``REFUSED``).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Callable, NamedTuple, Sequence

from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from .engine import multiprocessing_error
from .inputs import RecordError, unresolved
from .liveness import NODE_SILENCE_S, NODE_WAIT_S

USAGE = "kvfill-record --model MODEL --prompts FILE --out BANK [kvfill options] [vLLM engine options]"

# record()'s named parameters: the recorder reads these itself (tokenizer,
# size estimate, provenance), so they are not hidden in llm_kwargs.
NAMED = ("dtype", "kv_cache_dtype", "block_size", "tokenizer", "max_model_len")

# The recorder's own LLM settings (engine_config.engine_kwargs) against a user's value:
# - enforce_eager: not set; vLLM's default (compiled, as `vllm serve` runs) or
#   the user's flag.  Eager or compiled, the rows are read after the whole
#   forward (wait_for_save); the mode is in the bank's provenance
#   (``compilation``), and a serving run in another mode says so at start.
# - max_num_batched_tokens, max_num_seqs: honoured; they batch the prompts,
#   they do not change which rows are read.  vLLM needs max_num_batched_tokens
#   >= max_model_len without chunked prefill (checked below when both given;
#   without --max-model-len the recorder's default stays within it:
#   inputs.default_max_model_len).
# - disable_log_stats=True: honoured (logging only).
# - enable_prefix_caching=False, enable_chunked_prefill=False: a False is
#   honoured, a True refused (REFUSED).
# - kv_transfer_config: refused; the recorder's connector is the point of it.
# - speculative_config (--speculative-config, --spec-*): honoured.  vLLM runs
#   the drafter over the prompt in the prefill step and saves the connector's
#   KV after it (wait_for_save deferred past the drafter), so the drafter's
#   KV cache layers (a draft model's, an EAGLE head's, MTP layers) are
#   recorded with the target's: what a replay served with the same drafter
#   needs.
# - model, tokenizer, dtype, kv_cache_dtype, max_model_len, block_size: named.


class Refusal(NamedTuple):
    """An engine flag recording cannot honour: ``applies(value)`` says when."""
    dest: str
    applies: Callable[[Any], bool]
    reason: str


def _set(value) -> bool:
    return value is not None


def _over_1(value) -> bool:
    return value is not None and value > 1


REFUSED = (
    Refusal("decode_context_parallel_size", _over_1,
            "DCP splits a layer's positions across ranks, not its heads: record a model served with DCP at the "
            "same --tensor-parallel-size with --decode-context-parallel-size 1; the bank replays under any DCP "
            "size"),
    Refusal("prefill_context_parallel_size", _over_1,
            "prefill context parallelism splits each prompt's positions across ranks: record with "
            "--prefill-context-parallel-size 1 (every position of a layer on its rank)"),
    Refusal("data_parallel_size", _over_1,
            "data-parallel ranks are separate engines: record with one (--data-parallel-size 1); the bank "
            "replays on each"),
    Refusal("kv_transfer_config", _set,
            "the recorder sets its own KV connector (KVFillConnector in its record role); the replay "
            "connector's config belongs to the serving run"),
    Refusal("kv_offloading_size", _set,
            "KV offloading is a KV connector of its own (vLLM's OffloadingConnector or LMCache), in the place "
            "the recorder's connector takes"),
    Refusal("enable_prefix_caching", bool,
            "the recorder turns prefix caching off so every prompt is prefilled for real, in its own blocks"),
    Refusal("enable_chunked_prefill", bool,
            "the recorder prefills each prompt in one step: with chunks, vLLM frees sliding-window blocks "
            "behind the window between chunks, before the rows are read"),
    Refusal("long_prefill_token_threshold", lambda v: v > 0,
            "it caps the tokens of a long prompt per step, which splits its prefill into chunks even with "
            "chunked prefill off (vLLM frees sliding-window blocks between chunks, before the rows are read)"),
    Refusal("max_num_scheduled_tokens", _set,
            "the recorder schedules each prompt whole in one step (chunked prefill off): a per-step cap under a "
            "prompt's length holds it back"),
    Refusal("diffusion_config", _set,
            "diffusion decoding runs on the speculative-decoding path (a canvas of draft tokens each step); "
            "recording prefills each prompt and generates one token"),
    Refusal("runner", lambda v: v in ("pooling", "draft"),
            "recording generates one token per prompt; this runner has no generate"),
    Refusal("convert", lambda v: v in ("embed", "classify"),
            "it converts the model into a pooling model, which has no generate"),
    Refusal("tokenizer_mode", lambda v: v not in ("auto", "hf"),
            "the recorder tokenizes the prompts itself with transformers' AutoTokenizer and the bank keys its "
            "rows by those token ids; this tokenizer mode may make other ids of the same prompts"),
    Refusal("revision", _set,
            "the recorder reads the model's tokenizer and config at the default revision: download this "
            "revision into a folder and pass the folder as --model"),
    Refusal("tokenizer_revision", _set,
            "the recorder reads the tokenizer at the default revision: download this revision into a folder "
            "and pass the folder as --tokenizer"),
    Refusal("max_model_len", lambda v: v == -1,
            "'auto' (-1) is what fits memory, unknown before vLLM starts: give the serving run's number (for "
            "bit-identical KV) or leave the flag out (the longest prompt + 16)"),
)


class RecordArgumentParser(FlexibleArgumentParser):
    """vLLM's parser, but a plain ``--help`` lists every flag (vLLM's lists
    only its config groups and hides each flag behind ``--help=GROUP``), and
    ``typed`` keeps each value as typed (``auto``, a JSON string) for the
    errors: parsed, a config object shows every field of its dataclass."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.typed: dict[str, str] = {}

    def _get_value(self, action, arg_string):  # argparse's one conversion of every typed value
        self.typed[action.dest] = arg_string
        return super()._get_value(action, arg_string)

    def format_help(self):
        if FlexibleArgumentParser._search_keyword is None:  # set by --help=KEYWORD
            return argparse.ArgumentParser.format_help(self)
        return super().format_help()


def build_parser() -> RecordArgumentParser:
    """kvfill's flags (listed first in --help), then vLLM's engine flags."""
    p = RecordArgumentParser(
        prog="kvfill-record", usage=USAGE,
        description="Record real KV rows of prompts into a bank for kvfill's replay fill (fill_mode 'replay'). "
                    "Takes vLLM's engine flags as `vllm serve` does; --help=GROUP or --help=WORD shows a part.")
    own = p.add_argument_group("kvfill-record", "The recording: prompts in, bank out. --model (required) is "
                                               "vLLM's, listed under ModelConfig.")
    own.add_argument("--prompts", required=True,
                     help="UTF-8 text file, one prompt per line (blank lines skipped), or a .jsonl file of "
                          "{\"prompt\": ...} objects (vLLM's custom dataset format; prompts with line breaks)")
    own.add_argument("--out", required=True, help="bank file to write (.safetensors), in an existing writable folder")
    own.add_argument("--positions", type=int, default=None,
                     help="the most positions recorded per prompt; None: every prompt whole, each its own "
                          "length")
    own.add_argument("--budget-gib", type=float, default=None, help="refuse a bank larger than this (GiB > 0)")
    own.add_argument("--node-wait", type=float, default=NODE_WAIT_S, metavar="SECONDS",
                     help="over several nodes (--nnodes): how long a node waits for the others to come up; a node "
                          "that goes away later fails every node within seconds (default %(default)g)")
    own.add_argument("--node-silence", type=float, default=NODE_SILENCE_S, metavar="SECONDS",
                     help="over several nodes: how long a node may go without a beat (one a second) before the "
                          "others take it as gone and stop the recording; raise it on hosts that pause "
                          "processes (a loaded host, a debugger, a live migration) (default %(default)g)")
    own.add_argument("--config", default=None,
                     help="a YAML file of vLLM engine flags (as `vllm serve --config`); flags given on the "
                          "command line win")
    EngineArgs.add_cli_args(p)
    _require_model(p)
    return p


def _require_model(p: argparse.ArgumentParser) -> None:
    """vLLM's --model has a default model; recording one nobody named is a
    mistake.  add_cli_args leaves --model out when the process's own argv
    holds "serve" and "--help": then it is added here."""
    model = next((a for a in p._actions if a.dest == "model"), None)
    if model is None:
        model = p.add_argument("--model")
    model.required = True
    model.default = None
    model.help = "the model folder or name vLLM loads (and the recorder tokenizes with, unless --tokenizer)"


_UNSET = object()


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> tuple[argparse.Namespace, set[str]]:
    """The flags' values, and the names of those the user gave: a flag given
    with the engine's default value (--no-enforce-eager) still overrides the
    recorder's own setting.  argparse fills in a default only where the
    namespace lacks the name, so a second parse into a namespace of
    placeholders leaves exactly the flags given."""
    FlexibleArgumentParser._search_keyword = None  # set by a --help=WORD, never cleared by vLLM
    argv = _split_config(list(sys.argv[1:] if argv is None else argv))
    args = _parse_into(p, argv, None)
    dests = {a.dest for a in p._actions if a.dest != argparse.SUPPRESS}
    marked = _parse_into(p, argv, argparse.Namespace(**dict.fromkeys(dests, _UNSET)))
    return args, {d for d, v in vars(marked).items() if v is not _UNSET}


def _split_config(argv: list[str]) -> list[str]:
    """``--config=FILE`` as ``--config FILE``: vLLM's parser reads the YAML
    file only in that form (the other one would be stored and ignored)."""
    out = []
    for arg in argv:
        out.extend(arg.split("=", 1) if arg.startswith("--config=") else [arg])
    return out


def _parse_into(p: argparse.ArgumentParser, argv: list[str], namespace) -> argparse.Namespace:
    """argparse's errors exit 2 as usual; so do those vLLM's parser raises
    as exceptions: a bad --config (ValueError, OSError, an assertion) and a
    last ``--json-arg.key`` without its value (it reads past the end)."""
    import yaml

    try:
        return p.parse_args(argv, namespace)
    except (ValueError, OSError, AssertionError, yaml.YAMLError) as exc:
        p.error(f"--config: {exc}")
    except IndexError:
        p.error(f"argument {argv[-1]}: expected one argument")


def refusals(p: RecordArgumentParser, args: argparse.Namespace, given: set[str]) -> list[str]:
    """One message per engine flag given with a value recording cannot
    honour, each naming the flag, the value and why."""
    flags = {a.dest: a.option_strings[0] for a in p._actions if a.option_strings}
    found = [f"{flags[r.dest]} {p.typed.get(r.dest, getattr(args, r.dest))}: {r.reason}"
             for r in REFUSED if r.dest in given and r.applies(getattr(args, r.dest))]
    tokens, max_len = getattr(args, "max_num_batched_tokens", None), getattr(args, "max_model_len", None)
    if tokens is not None and max_len is not None and max_len > 0 and tokens < max_len:
        found.append(f"--max-num-batched-tokens {tokens}: the recorder prefills each prompt whole in one step "
                     f"(chunked prefill off), so vLLM needs it >= --max-model-len {max_len}")
    return found


def record_call(argv: Sequence[str] | None = None) -> dict:
    """``record()``'s keyword arguments from the command line.  Raises
    RecordError (refused flags, or an engine config vLLM rejects) before
    vLLM starts; argparse's own errors exit 2."""
    p = build_parser()
    args, given = parse(p, argv)
    line = multiprocessing_error()
    if line:
        raise RecordError(line)
    found = refusals(p, args, given)
    if found:
        raise RecordError("recording cannot honour these vLLM flags:\n  " + "\n  ".join(found))
    _check_engine_args(args)
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    engine = {name: getattr(args, name) for name in sorted(given & fields) if name != "model"}
    named = {name: engine.pop(name) for name in NAMED if name in engine}
    return dict(model=args.model, prompts_file=args.prompts, out=args.out, positions=args.positions,
                budget_gib=args.budget_gib, node_wait=args.node_wait, node_silence=args.node_silence, **named, llm_kwargs=engine)


def _check_engine_args(args: argparse.Namespace) -> None:
    """Build the EngineArgs as ``vllm serve`` does (from_cli_args): its
    checks of the config objects fail here, before the recorder reads any
    input, instead of after it tokenized every prompt."""
    try:
        EngineArgs.from_cli_args(args)
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        raise RecordError(f"vLLM rejected the engine flags: {exc}") from None
    except Exception as exc:  # the hub's errors: with HF_HUB_OFFLINE=1 vLLM resolves names in its cache here
        raise RecordError(unresolved(exc, model=args.model, tokenizer=getattr(args, "tokenizer", None))) from None

