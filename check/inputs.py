"""kvfill-check's inputs, read and checked before anything is written: the
prompts' token ids, the runs' ``max_model_len`` against the prompts and the
model, a given bank, the decoys.  A value the check cannot run with is a
CheckError naming it and what was expected, raised before ``--out`` exists
(``python -m kvfill.check`` exits 2); what fails after that is a step's
failure, in the report.
"""
from __future__ import annotations

import collections
import dataclasses
import math

from .cli import CheckConfig, CheckError

MAX_LEN_SLACK = 16  # the runs' default max_model_len: the longest prompt + the longest output + this


@dataclasses.dataclass
class Inputs:
    tok: object
    ids: list[list[int]]
    max_len: int
    stats: dict | None  # a given --bank's value statistics (read_bank); None without --bank
    held: int | None = None  # how many prompts a given --bank holds whole (read_bank)


def prepare(cfg: CheckConfig) -> Inputs:
    """Everything the runs need that the user's input decides; CheckError (or
    kvfill-record's RecordError about the prompts file) before any write."""
    tok, ids = token_ids(cfg)
    longest, output = max(map(len, ids)), max(cfg.output_len, cfg.max_tokens)
    if cfg.decoys and cfg.decoys >= min(map(len, ids)) - 1:
        raise CheckError(f"--decoys {cfg.decoys}: expected fewer than the shortest prompt's tokens less one "
                         f"({min(map(len, ids)) - 1}): a decoy shares the first K tokens and differs after them")
    given = cfg.engine.get("max_model_len")
    max_len = given or longest + output + MAX_LEN_SLACK
    if given is not None and given < longest + output:
        raise CheckError(f"--max-model-len {given}: the longest prompt has {longest} tokens and each run generates "
                         f"up to {output} (--output-len {cfg.output_len}, --max-tokens {cfg.max_tokens}); expected "
                         f"--max-model-len >= {longest + output}, or fewer tokens asked for")
    check_model_len(cfg, max_len, f"--max-model-len {given}" if given else
                    f"the runs' max_model_len {max_len} (the longest prompt's {longest} tokens + {output} generated "
                    f"+ {MAX_LEN_SLACK})", "a smaller --max-model-len" if given else
                    "a lower --output-len / --max-tokens, or shorter prompts")
    stats = held = None
    if cfg.bank is not None:
        try:
            stats, held = read_bank(cfg.bank, ids)
        except (ValueError, OSError) as exc:  # BankError: not a bank, or one kvfill cannot read
            raise CheckError(f"--bank: {exc}; expected a bank kvfill-record wrote") from None
    return Inputs(tok, ids, max_len, stats, held)


def token_ids(cfg: CheckConfig) -> tuple[object, list[list[int]]]:
    """The tokenizer, and the prompts' token ids read and tokenized as
    kvfill-record does (so replay finds their rows)."""
    from transformers import AutoTokenizer

    from kvfill.record.inputs import read_prompts, unresolved

    trust = bool(cfg.engine.get("trust_remote_code", False))
    prompts = read_prompts(cfg.prompts)  # RecordError (a ValueError) naming the file and line
    try:
        tok = AutoTokenizer.from_pretrained(cfg.engine.get("tokenizer") or cfg.model, trust_remote_code=trust)
    except Exception as exc:  # OSError, the hub's errors
        raise CheckError(unresolved(exc, model=cfg.model, tokenizer=cfg.engine.get("tokenizer"))) from None
    ids = [list(tok(p).input_ids) for p in prompts]
    empty = [i for i, t in enumerate(ids, 1) if not t]
    if empty:
        raise CheckError(f"--prompts {cfg.prompts!r}: prompt {empty[0]} tokenizes to no tokens; expected text the "
                         f"model's tokenizer makes at least one token of")
    return tok, ids


def check_model_len(cfg: CheckConfig, max_len: int, what: str, expected: str) -> None:
    """vLLM's own check of a max_model_len against the model (its derived
    maximum: positions, rope scaling, the tokenizer's limit), as each run's
    engine makes it."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=cfg.model, **cfg.engine)
    args.max_model_len = max_len
    try:
        args.create_model_config()
    except ValueError as exc:  # pydantic's ValidationError
        lines = [line.strip() for line in str(exc).splitlines()]
        why = next((line for line in lines if "max_model_len" in line), lines[-1]).removeprefix("Value error, ")
        why = why.split(". ")[0].split(" [type=")[0]  # its first sentence: pydantic appends the whole input
        raise CheckError(f"{what}: vLLM refuses it for this model ({why}); expected {expected}") from None
    except Exception as exc:  # noqa: BLE001 - the hub's errors, a config transformers cannot read
        raise CheckError(f"--model {cfg.model!r}: vLLM cannot make its model config ({type(exc).__name__}: "
                         f"{exc})") from None


def read_bank(path: str, ids: list[list[int]]) -> tuple[dict | None, int | None]:
    """A bank read once for two facts: the mean and std of its KV values
    (its float rows, decoded as stored: an fp8 cache's bytes as fp8; K and V
    apart where the bank names a layer's K/V geometry), None when it holds
    no float rows; and how many of the prompts it holds whole (one recorded
    sequence starts with all of a prompt's tokens, from the bank's index),
    None for a bank without its sequences' token ids.  Replay gives any
    other prompt, block by block, rows of a recorded sequence picked by the
    block's token hash.

    The rows stream through one bounded buffer (``kvfill.bank.stream``), so
    the host holds a chunk of the bank, never the bank.  The statistics:
    ``mean``, ``std`` (every value), ``k_std``, ``v_std`` (None without a
    layer of known geometry, ``v_std`` None for MLA's latent rows, which
    hold no V), ``sequences``, ``has_state`` (recurrent state recorded), and
    ``source``, a line saying which layers they were computed from and how
    their bytes were read."""
    from kvfill.bank import BankIndex
    from kvfill.bank.stream import read_stored, row_chunks

    stored = read_stored(path)
    index = BankIndex.read(path)  # metadata alone
    held = None if index.tokens is None else sum(index.holds(t) for t in ids)
    used = [layer for layer in stored.layers.values() if layer.values is not None]
    if not used:
        return None, held
    k, v, unsplit = _Moments(), _Moments(), _Moments()
    for layer in used:
        width = layer.kv[0] * layer.kv[1] if layer.kv else None  # K's elements: a canonical row is K then V
        for rows in row_chunks(path, layer):
            values = rows if rows.dtype == layer.values else rows.view(layer.values)
            if width is None:
                unsplit.add(values)
            else:
                k.add(values[:, :width])
                v.add(values[:, width:])
    every = _Moments.of(k, v, unsplit)
    return {"mean": every.mean, "std": every.std(), "k_std": k.std(), "v_std": v.std(),
            "sequences": stored.num_sequences, "has_state": stored.has_state,
            "source": _source(stored, used, unsplit.n > 0)}, held


class _Moments:
    """Count, mean and sum of squared deviations of values seen a chunk at a
    time, in float64 (each chunk's own by torch, merged by Chan, Golub and
    LeVeque's pairwise update: no sum of squares to cancel)."""

    def __init__(self):
        self.n, self.mean, self.m2 = 0, 0.0, 0.0

    @classmethod
    def of(cls, *parts: "_Moments") -> "_Moments":
        out = cls()
        for p in parts:
            out.merge(p.n, p.mean, p.m2)
        return out

    def add(self, values) -> None:
        import torch

        if values.numel():
            var, mean = torch.var_mean(values.double(), correction=0)
            self.merge(values.numel(), mean.item(), var.item() * values.numel())

    def merge(self, n: int, mean: float, m2: float) -> None:
        if not n:
            return
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total

    def std(self) -> float | None:
        """The sample std (as torch's ``std()``); None of no values, NaN of one."""
        if not self.n:
            return None
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else math.nan


def _source(stored, used: list, unsplit: bool) -> str:
    """What a bank's statistics were computed from, in one line."""
    from kvfill.bank import dtype_name

    kinds = collections.Counter(dtype_name(layer.values) + ("" if layer.dtype == layer.values else
                                                            f" stored as {dtype_name(layer.dtype)}")
                                for layer in used)
    if len(kinds) == 1:
        text = f"the bank's {len(used)} KV layers of {next(iter(kinds))}"
    else:
        text = f"the bank's {len(used)} KV layers ({', '.join(f'{n} {kind}' for kind, n in kinds.items())})"
    if any(layer.values.itemsize == 1 for layer in used):
        text += ("; fp8 values as stored: the bank records no KV scales, so this is the spread vLLM reads at k/v "
                 "scale 1 - the normal fill stores its values unscaled too, so both meet the layers' scales alike")
    if unsplit:
        text += (f"; K and V told apart in the {sum(layer.kv is not None for layer in used)} layers whose K/V "
                 f"geometry the bank names")
    left = len(stored.layers) - len(used)
    if left:
        text += f"; {left} layer{'' if left == 1 else 's'} of no float values (packed rows, integers) left out"
    return text
