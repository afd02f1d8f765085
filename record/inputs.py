"""The recorder's inputs, checked before vLLM starts: ``--out``'s folder, the
prompts file (UTF-8, one prompt per line, or JSONL ``{"prompt": ...}`` per
line; named by line), the budget and the
size estimate from the model's config, the prompts' lengths against
``--positions`` and ``--max-model-len``.  A ``RecordError`` names the value
and what was expected; nothing is written.
"""
from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import re
from typing import Sequence


class RecordError(ValueError):
    """Bad input to the recorder: names the value and what was expected."""

@dataclasses.dataclass(frozen=True)
class Estimate:
    sequences: int
    positions: int        # recorded in all: the sum of the sequences' lengths (a ragged bank stores no more)
    bytes_per_token: int  # layers x row bytes
    layers: int
    state_bytes_per_sequence: int = 0  # the state section (models with recurrent state): every state layer whole

    @property
    def nbytes(self) -> int:
        return self.positions * self.bytes_per_token + self.sequences * self.state_bytes_per_sequence

    def __str__(self) -> str:
        states = (f" + {self.sequences} sequences x {self.state_bytes_per_sequence} B of recurrent state"
                  if self.state_bytes_per_sequence else "")
        return (f"{self.sequences} sequences, {self.positions} positions in all x {self.bytes_per_token} B per "
                f"token ({self.layers} attention layers){states} = {self.nbytes / 2**20:.1f} MiB")


_KV_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "fp8_ds_mla": 1}
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
# transformers' ``layer_types`` of layers a bank does not hold: recurrent state
# (linear_attention: Mamba, GDN, lightning attention; "mamba" is its legacy
# name), short convolutions, MoE-only layers (nemotron_h) and chunked-local
# attention (replayed with the synthetic fill, never recorded).  Full and
# sliding attention are recorded; a type not named here counts too, so the
# estimate errs on the budget's side.
_UNBANKED_LAYER_TYPES = frozenset({"linear_attention", "mamba", "conv", "moe", "chunked_attention"})


def estimate(model: str, sequences: int, positions: int, dtype: str = "auto", kv_cache_dtype: str = "auto",
             trust_remote_code: bool = False) -> Estimate:
    """Bank size from the model's config.json: ``positions`` (recorded in
    all) x attention layers x K+V row bytes (MLA: the latent + rope row, or
    ``fp8_ds_mla``'s 656-B row; sparse attention: + the indexer's key and
    scale).  An estimate: the bank written is checked too."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    layers = text.num_hidden_layers
    types = getattr(text, "layer_types", None)
    if types:  # hybrid models: only the layers a bank holds
        layers = sum(1 for t in types if t not in _UNBANKED_LAYER_TYPES)
    if kv_cache_dtype in _KV_DTYPE_BYTES:
        itemsize = 1
    else:
        name = dtype if dtype != "auto" else str(getattr(text, "dtype", None) or getattr(text, "torch_dtype", "bfloat16"))
        itemsize = _DTYPE_BYTES.get(name.removeprefix("torch."), 2)
    if kv_cache_dtype == "fp8_ds_mla":  # packed latent rows: fp8 values, a float32 scale per 128, bf16 RoPE part
        nbytes = text.kv_lora_rank + text.kv_lora_rank // 128 * 4 + text.qk_rope_head_dim * 2
    elif kv_cache_dtype == "nvfp4_ds_mla":  # e2m1 values two a byte, e4m3 RoPE values, an e4m3 scale per 16
        nbytes = text.kv_lora_rank // 2 + text.qk_rope_head_dim + text.kv_lora_rank // 16
    elif getattr(text, "kv_lora_rank", None):  # MLA
        nbytes = (text.kv_lora_rank + text.qk_rope_head_dim) * itemsize
    else:
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        nbytes = 2 * heads * head_dim * itemsize
    if getattr(text, "index_topk", None):  # DeepSeek-V3.2 / GLM-5 sparse attention: the indexer's fp8 keys + scale
        nbytes += int(getattr(text, "index_head_dim", 128)) + 4
    return Estimate(sequences, positions, layers * nbytes, layers)


def with_drafter(est: Estimate, model: str, spec: dict, dtype: str = "auto", kv_cache_dtype: str = "auto",
                 trust_remote_code: bool = False) -> Estimate:
    """``est`` with the drafter's KV layers, which a recording under the
    speculative config ``spec`` records too: a draft model's or an EAGLE
    head's (the config at ``spec["model"]``), or the model's own MTP layers
    (``num_nextn_predict_layers``, rows like its own).  Methods without a
    drafter model (ngram, suffix) add none."""
    method, path = spec.get("method"), spec.get("model")
    if method in ("ngram", "ngram_gpu", "suffix"):
        return est
    if path:
        d = estimate(path, est.sequences, est.positions, dtype, kv_cache_dtype, trust_remote_code)
        return Estimate(est.sequences, est.positions, est.bytes_per_token + d.bytes_per_token, est.layers + d.layers)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    n = int(getattr(text, "num_nextn_predict_layers", 0) or 0)
    if not n or not est.layers:
        return est
    per_layer = est.bytes_per_token // est.layers
    return Estimate(est.sequences, est.positions, est.bytes_per_token + n * per_layer, est.layers + n)


def check_budget(budget_gib: float | None) -> None:
    """A budget compares with nothing when NaN, refuses every bank when <= 0
    and none when infinite: each is a mistake, refused before anything runs."""
    if budget_gib is not None and not (math.isfinite(budget_gib) and budget_gib > 0):
        raise RecordError(f"--budget-gib {budget_gib} is invalid; expected a finite number of GiB > 0")


def check_out(out: str) -> None:
    """``--out`` can take the bank, checked before vLLM starts: found after the
    run, a bad path cost the whole run (and the work folder is made beside it)."""
    if os.path.isdir(out) or out.endswith(("/", os.sep)):
        raise RecordError(f"--out {out!r} is a directory; expected the path of the bank file to write "
                          f"(e.g. {os.path.join(out, 'bank.safetensors')!r})")
    if os.path.exists(out) and not os.path.isfile(out):
        raise RecordError(f"--out {out!r} exists and is not a regular file; expected the path of the bank file")
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        what = "is not a directory" if os.path.exists(folder) else "does not exist"
        raise RecordError(f"--out {out!r}: its folder {folder!r} {what}; expected an existing folder "
                          f"(create it first)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise RecordError(f"--out {out!r}: its folder {folder!r} is not writable; expected a folder the "
                          f"recorder can write the bank (and its work folder) in")


def check_nodes(llm_kwargs: dict, node_wait: float, node_silence: float) -> None:
    """``--node-rank`` names a node of a recording over ``--nnodes`` > 1
    nodes: without it a further node would start workers that join whatever
    listens at the default master address.  ``--node-wait`` and
    ``--node-silence``: seconds > 0."""
    for flag, value, what in (("--node-wait", node_wait, "how long a node waits for the other nodes of a recording "
                                                         "to come up"),
                              ("--node-silence", node_silence, "how long a node may go without a beat before the "
                                                               "others take it as gone")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise RecordError(f"{flag} {value!r}: expected a number of seconds > 0 ({what})")
    node, nnodes = int(llm_kwargs.get("node_rank") or 0), int(llm_kwargs.get("nnodes") or 1)
    if node and nnodes <= 1:
        raise RecordError(f"--node-rank {node} without --nnodes: expected --nnodes N > {node} (the recording's "
                          f"node count) with --master-addr and --master-port of the first node, or no --node-rank "
                          f"on a one-node recording")
    if node >= nnodes > 1:
        raise RecordError(f"--node-rank {node} with --nnodes {nnodes}: expected a node rank below {nnodes}")


def check_max_model_len(max_model_len: int | None, positions: int | None) -> None:
    """vLLM takes prompts of at most ``max_model_len - 1`` tokens (one
    position is left for the token it generates): N must fit that."""
    if max_model_len is None:
        return
    if max_model_len < 2:
        raise RecordError(f"--max-model-len {max_model_len} is invalid; expected an int >= 2 "
                          f"(a prompt token and the one generated)")
    if positions is not None and positions > max_model_len - 1:
        raise RecordError(f"--positions {positions} is over --max-model-len {max_model_len}: vLLM takes prompts "
                          f"of at most {max_model_len - 1} tokens (one position is left for the token it "
                          f"generates); expected --positions <= {max_model_len - 1} or a larger --max-model-len")


def _check_text_file(path: str) -> None:
    if not os.path.exists(path):
        raise RecordError(f"--prompts {path!r} does not exist; expected a text file with one prompt per line")
    if os.path.isdir(path):
        raise RecordError(f"--prompts {path!r} is a directory; expected a text file with one prompt per line")
    if not os.path.isfile(path):  # a device (/dev/zero), pipe or socket: maybe endless, never a prompts file
        raise RecordError(f"--prompts {path!r} is not a regular file; expected a text file with one prompt per line")


def read_prompt_lines(path: str) -> list[tuple[int, str]]:
    """(line number in the file, prompt) of each non-blank line: errors about a
    prompt name the line a person sees in an editor, blank lines counted."""
    prompts = _lines_of(path)
    if path.endswith(".jsonl"):
        return [(no, _json_item(path, no, line)["prompt"]) for no, line in prompts]
    return prompts


def _lines_of(path: str) -> list[tuple[int, str]]:
    """(line number, line) of each non-blank line of the UTF-8 text file ``path``."""
    _check_text_file(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise RecordError(f"--prompts {path!r} cannot be read ({exc.strerror}); expected a readable text file"
                          ) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise RecordError(f"--prompts {path!r} is not UTF-8 text: line {line} holds bytes that are not UTF-8 "
                          f"(0x{data[exc.start]:02x} at file offset {exc.start}); expected UTF-8 text, one prompt "
                          f"per line") from None
    lines = io.StringIO(text, newline=None)  # \n, \r\n and \r end a line, as in open()'s text mode
    prompts = [(no, line.rstrip("\n")) for no, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise RecordError(f"--prompts {path!r} holds no prompt; expected one prompt per line")
    return prompts


def _json_item(path: str, no: int, line: str) -> dict:
    """One JSONL line's object, holding a non-empty string ``prompt``
    (vLLM's custom benchmark dataset format: ``{"prompt": "..."}``, other
    keys ignored but ``class``): a prompt with line breaks, e.g. a chat
    template's, the way a text file cannot hold one."""
    try:
        item = json.loads(line)
    except ValueError as exc:
        raise RecordError(f"--prompts {path!r} line {no} is not JSON ({exc}); expected one object "
                          f'{{"prompt": "..."}} per line') from None
    prompt = item.get("prompt") if isinstance(item, dict) else None
    if not isinstance(prompt, str) or not prompt:
        raise RecordError(f"--prompts {path!r} line {no}: expected an object with a non-empty string \"prompt\", "
                          f"got {line[:80]!r}")
    return item


def read_prompts(path: str) -> list[str]:
    """One prompt per non-empty line."""
    return [prompt for _, prompt in read_prompt_lines(path)]


CLASS_CHARS = re.compile(r"[A-Za-z0-9_.+-]{1,32}")


def read_prompt_classes(path: str) -> list[str] | None:
    """Each prompt's class, for kvfill-check's figures per class: a JSONL
    line's ``"class"`` (e.g. code, prose, chat: 1-32 letters, digits or
    ``_.+-``), in the prompts' order; None where no line names one (a text
    file, or JSONL without the key).  Where some lines name one, every line
    must: a RecordError names the first that does not, or a bad value."""
    if not path.endswith(".jsonl"):
        return None
    items = [(no, _json_item(path, no, line)) for no, line in _lines_of(path)]  # each an object with a prompt
    named = [no for no, item in items if "class" in item]
    if not named:
        return None
    out = []
    for no, item in items:
        value = item.get("class")
        if not isinstance(value, str) or not CLASS_CHARS.fullmatch(value):
            raise RecordError(f"--prompts {path!r} line {no}: \"class\" is {value!r}; expected 1-32 letters, digits "
                              f"or _.+- on every line once one line names a class (line {named[0]} does)")
        out.append(value)
    return out


def choose_positions(token_ids: Sequence[Sequence[int]], positions: int | None) -> list[int]:
    """Each prompt's recorded length: the whole prompt, or at most
    ``positions`` tokens of it (``--positions``, an int >= 1)."""
    if positions is not None and (isinstance(positions, bool) or not isinstance(positions, int) or positions < 1):
        raise RecordError(f"--positions {positions!r} is invalid; expected an int >= 1 (the most positions recorded "
                          f"per prompt)")
    return [len(t) if positions is None else min(len(t), positions) for t in token_ids]


def check_prompt_lengths(token_ids: Sequence[Sequence[int]], line_numbers: Sequence[int],
                         max_model_len: int | None) -> None:
    """Every prompt, as recorded (``--positions`` applied), holds a token and
    fits ``--max-model-len`` (``check_max_model_len``): found by vLLM, either
    would fail after the engine started."""
    empty = [no for no, t in zip(line_numbers, token_ids) if not len(t)][:5]
    if empty:
        raise RecordError(f"prompt line(s) {empty} tokenize to no token; expected prompts of at least one token "
                          f"(vLLM refuses an empty prompt)")
    if max_model_len is None:  # the default fits the longest prompt
        return
    long = [(no, len(t)) for no, t in zip(line_numbers, token_ids) if len(t) > max_model_len - 1][:5]
    if long:
        raise RecordError(f"--max-model-len {max_model_len}: prompt line(s) {[no for no, _ in long]} have "
                          f"{[n for _, n in long]} tokens; vLLM takes at most {max_model_len - 1} (one position "
                          f"is left for the token it generates); expected shorter prompts or a larger --max-model-len")


def default_max_model_len(token_ids: Sequence[Sequence[int]], line_numbers: Sequence[int],
                          max_num_batched_tokens: int | None = None) -> int:
    """vLLM's max_model_len when ``--max-model-len`` is not given: the longest
    recorded prompt + 16, at most ``--max-num-batched-tokens`` - the recorder
    prefills each prompt whole in one step (chunked prefill off), and vLLM
    then needs max_num_batched_tokens >= max_model_len."""
    longest = max(len(t) for t in token_ids)
    if max_num_batched_tokens is None:
        return longest + 16
    if max_num_batched_tokens < longest + 1:
        no = next(no for no, t in zip(line_numbers, token_ids) if len(t) == longest)
        raise RecordError(f"--max-num-batched-tokens {max_num_batched_tokens}: the recorder prefills each prompt "
                          f"whole in one step (chunked prefill off), and prompt line {no} is recorded with "
                          f"{longest} tokens (and one position for the token generated); expected "
                          f"--max-num-batched-tokens >= {longest + 1}, or --positions "
                          f"{max_num_batched_tokens - 1} or less")
    return min(longest + 16, max_num_batched_tokens)


def unresolved(exc: Exception, *, model: str, tokenizer: str | None) -> str:
    """One line for a model or tokenizer name that cannot be loaded: neither a
    folder here nor a name the hub (or, offline, its cache) has."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    names = [f"--{flag} {name!r}" for flag, name in (("model", model), ("tokenizer", tokenizer))
             if name and not os.path.exists(name)]
    where = "in the hub's local cache (HF_HUB_OFFLINE is set)" if offline else "on the hub"
    detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    return (f"{' and '.join(names) or f'--model {model!r}'} cannot be loaded: not a folder here and not found "
            f"{where} ({type(exc).__name__}: {detail}); expected a model folder or a name the hub has")
