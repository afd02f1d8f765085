"""kvfill-check's inputs, read and checked before anything is written: the
prompts' token ids and classes, the runs' ``max_model_len`` against the
prompts and the model, a given bank, the decoys.  A value the check cannot
run with is a CheckError naming it and what was expected, raised before
``--out`` exists (``python -m kvfill.check`` exits 2); what fails after
that is a step's failure, in the report."""
from __future__ import annotations

import collections
import dataclasses
import math
import os

from .cli import CheckConfig, CheckError
from .depths import cut_prompts
from .prompts import token_ids
from .past_bank import check_rotate

MAX_LEN_SLACK = 16  # the runs' default max_model_len: the longest prompt + the longest output + this


@dataclasses.dataclass
class Inputs:
    tok: object
    ids: list[list[int]]
    max_len: int
    stats: dict | None  # a given --bank's value statistics (read_bank); None without --bank
    held: int | None = None  # how many prompts a given --bank holds whole (read_bank)
    classes: list[str] | None = None  # each prompt's class, from a JSONL prompts file (None: not given)
    depths: list[str] | None = None  # --depths: each prompt's depth label (None without)
    texts: list[str] | None = None  # --depths: the cut prompts' texts (what runner.write_depth_prompts writes)


def prepare(cfg: CheckConfig) -> Inputs:
    """Everything the runs need that the user's input decides; CheckError (or
    kvfill-record's RecordError about the prompts file) before any write."""
    tok, texts, ids, classes = token_ids(cfg)
    texts, ids, classes, labels = cut_prompts(cfg, tok, texts, ids, classes)
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
    model = check_model_len(cfg, max_len, f"--max-model-len {given}" if given else
                            f"the runs' max_model_len {max_len} (the longest prompt's {longest} tokens + {output} "
                            f"generated + {MAX_LEN_SLACK})", "a smaller --max-model-len" if given else
                            "a lower --output-len / --max-tokens, or shorter prompts")
    check_rotate(model, max_len, cfg.past_bank)  # what replay would refuse at its registration, refused now
    for run, own in cfg.also_replay.items():  # --also-replay's runs: the same, with their own settings
        check_rotate(model, max_len, own.get("past_bank", cfg.past_bank))
        if "bank" in own:
            _given_bank(cfg, model, own["bank"], f"--also-replay {run}: bank")
    stats = held = None
    if cfg.bank is not None:
        _given_bank(cfg, model, cfg.bank, "--bank")
        try:
            stats, held = read_bank(cfg.bank, ids)
        except (ValueError, OSError) as exc:
            raise CheckError(f"--bank: {exc}; expected a bank kvfill-record wrote") from None
    return Inputs(tok, ids, max_len, stats, held, classes, labels, texts)


def _given_bank(cfg: CheckConfig, model, path: str, flag: str) -> None:
    """A bank the user gave, refused (CheckError naming ``flag``) where
    kvfill cannot read it or it cannot replay into ``model``, from its
    header, before any row is read."""
    from kvfill.bank.stream import read_stored

    try:
        stored = read_stored(path)
    except (ValueError, OSError) as exc:  # BankError: not a bank, or one kvfill cannot read
        raise CheckError(f"{flag}: {exc}; expected a bank kvfill-record wrote") from None
    check_bank_fits(cfg, model, stored, flag)


def check_model_len(cfg: CheckConfig, max_len: int, what: str, expected: str):
    """vLLM's own check of a max_model_len against the model (its derived
    maximum: positions, rope scaling, the tokenizer's limit), as each run's
    engine makes it; the ``ModelConfig`` it makes."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=cfg.model, **cfg.engine)
    args.max_model_len = max_len
    try:
        return args.create_model_config()
    except ValueError as exc:  # pydantic's ValidationError
        lines = [line.strip() for line in str(exc).splitlines()]
        why = next((line for line in lines if "max_model_len" in line), lines[-1]).removeprefix("Value error, ")
        why = why.split(". ")[0].split(" [type=")[0]  # its first sentence: pydantic appends the whole input
        raise CheckError(f"{what}: vLLM refuses it for this model ({why}); expected {expected}") from None
    except Exception as exc:  # noqa: BLE001 - the hub's errors, a config transformers cannot read
        raise CheckError(f"--model {cfg.model!r}: vLLM cannot make its model config ({type(exc).__name__}: "
                         f"{exc})") from None


# --kv-cache-dtype -> the float dtype an attention layer's cache values are (auto: the model's dtype); a cache
# dtype missing here (fp8_inc, packed, per-token-head scales) is not compared.
_CACHE_VALUES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def check_bank_fits(cfg: CheckConfig, model, stored, flag: str = "--bank") -> None:
    """A --bank whose replay into --model must fail, refused before any run:
    CheckError naming the bank's model and geometry and the model's.

    Replay checks each cache layer of the engine against the bank when vLLM
    registers the caches (``kvfill.bank.checks.check_rows``): the bank has
    rows of that layer's name, stored in the cache's dtype, encoding its
    values, of its K/V geometry (num_kv_heads, head_size, head_size_v of
    the whole model: a bank recorded at any TP, PP or DCP size holds every
    head, layer and position, and each rank loads its part).  Without an
    engine the check knows what vLLM's ``ModelConfig`` (``model``) says of
    the attention layers: their KV heads and head size (MLA: one latent
    row), how many there are, their dtype.  Refused here is only what
    check_rows would refuse whatever the layers' names: no layer of the
    bank has the model's geometry, the bank holds fewer layers than the model
    has attention layers with a cache of their own, or none of its layers of
    the model's geometry holds the values this run's cache holds.  Layers
    beyond the model's (a drafter's), hybrid models' state layers and
    layers in their cache's own order never refuse a bank.  The geometry
    and count are not compared for a bank recorded from --model itself
    (the same name), where vLLM's summary of an unusual model could be
    wrong while the bank cannot be."""
    from kvfill.bank import dtype_name

    recorded = stored.metadata.get("model")
    same = recorded is not None and (recorded == cfg.model or (
        os.path.exists(recorded) and os.path.exists(cfg.model) and os.path.samefile(recorded, cfg.model)))
    mla = bool(model.use_mla)
    arch = getattr(model, "model_arch_config", None)
    per_layer = [arch[i] for i in range(arch.total_num_hidden_layers)] if getattr(
        arch, "per_layer_overrides", None) else []
    geometry = {(1, model.get_head_size())} if mla else {(model.get_total_num_kv_heads(), model.get_head_size())}
    geometry |= {(1, c.head_size) if mla else (c.total_num_kv_heads, c.head_size) for c in per_layer}
    canonical = [layer for layer in stored.layers.values() if layer.kv is not None]
    fitting = [layer for layer in canonical if tuple(layer.kv[:2]) in geometry]
    attention = _attention_layers(model)
    cache = str(cfg.engine.get("kv_cache_dtype") or "auto")
    values = dtype_name(model.dtype) if cache == "auto" else _CACHE_VALUES.get(cache)
    expected = "a bank kvfill-record wrote for --model, or no --bank (the check records one)"
    if not same and canonical and not fitting:
        why = "no layer of the bank has the model's K/V geometry"
    elif not same and attention is not None and len(stored.layers) < attention:
        why = f"the bank holds {len(stored.layers)} KV layers, the model has {attention} attention layers"
    elif values and fitting and all(_values_name(layer) != values for layer in fitting):
        why = f"the bank's layers hold {_values_name(fitting[0])} values, this run's KV cache holds {values}"
        expected = (f"a bank recorded with this run's dtype ({dtype_name(model.dtype)}) and --kv-cache-dtype "
                    f"({cache}), or no --bank (the check records one)")
    else:
        return
    shapes = collections.Counter(str(list(layer.kv)) if layer.kv else "its cache's own order"
                                 for layer in stored.layers.values())
    bank = ((f"recorded from {recorded!r}" if recorded else "recorded from a model it does not name")
            + f": {len(stored.layers)} KV layers, " + ", ".join(f"{n} of {shape}" for shape, n in shapes.items())
            + " [KV heads, head_size, head_size_v]")
    head = (f"one latent row of {model.get_head_size()} (MLA)" if mla else
            f"{model.get_total_num_kv_heads()} KV heads x {model.get_head_size()}")
    layers = f"{attention} attention layers" if attention is not None else "attention layers"
    raise CheckError(f"{flag} {stored.path!r} ({bank}) cannot replay into --model {cfg.model!r} ({layers} of "
                     f"{head}, {dtype_name(model.dtype)}): {why}; expected {expected}")


def _attention_layers(model) -> int | None:
    """How many attention layers of ``model`` (vLLM's ModelConfig) have a KV
    cache of their own: vLLM's count of attention layers less those that
    share an earlier layer's cache (Gemma 3n's ``num_kv_shared_layers``);
    None for a hybrid model, whose count vLLM reads from layer type names
    that transformers renames (Granite-4-H's "attention" is now
    "full_attention": vLLM counts 0), or where vLLM cannot count them."""
    from vllm.config import ParallelConfig

    if model.is_hybrid:
        return None
    try:
        n = int(model.get_num_layers_by_block_type(ParallelConfig(), "attention"))
    except Exception:  # noqa: BLE001 - vLLM's count raises for a hybrid it has no layer types of
        return None
    shared = getattr(model.hf_text_config, "num_kv_shared_layers", 0)
    return n - shared if isinstance(shared, int) and 0 <= shared <= n else n


def _values_name(layer) -> str:
    """The float dtype a stored layer's bytes hold, by name ("" for none)."""
    from kvfill.bank import dtype_name

    return dtype_name(layer.values) if layer.values is not None else layer.value_dtype


def bank_coverage(path: str, ids: list[list[int]], block_size: int) -> dict | None:
    """What replay writes of the prompts (each all but its last token),
    position by position (``BankIndex.coverage``): ``own`` (the prompt's
    recorded rows), ``other`` (another recorded text's), ``wrapped`` (a
    sequence's rows past its recorded length, again from its start),
    ``positions`` in all and ``prompts_wrapped``, and the ``block_size``
    replay's blocks were cut by; None for a bank without its sequences'
    token ids (every block then picked by hash)."""
    from kvfill.bank import BankIndex

    index = BankIndex.read(path)
    if index.tokens is None:
        return None
    out = {"own": 0, "other": 0, "wrapped": 0, "positions": 0, "prompts_wrapped": 0}
    for t in ids:
        n = max(len(t) - 1, 1)
        own, other, wrapped = index.coverage(t, n, block_size)
        out["own"], out["other"], out["wrapped"] = out["own"] + own, out["other"] + other, out["wrapped"] + wrapped
        out["positions"] += n
        out["prompts_wrapped"] += wrapped > 0
    out["longest_sequence"] = int(index.lengths.max())
    out["block_size"] = int(block_size)
    return out


def read_bank(path: str, ids: list[list[int]]) -> tuple[dict | None, int | None]:
    """A bank read once for two facts: the mean and std of its KV values
    (its float rows, decoded as stored: an fp8 cache's bytes as fp8; K and V
    apart where the bank names a layer's K/V geometry), None when it holds
    no float rows; and how many of the prompts it holds whole (one recorded
    sequence starts with every token of the prompt a fill writes - all but
    its last, which vLLM computes; a hybrid's recording ends there - from
    the bank's index), None for a bank without its sequences' token ids.  Replay gives any
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
    held = None if index.tokens is None else sum(index.holds(t[:max(len(t) - 1, 1)]) for t in ids)
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
