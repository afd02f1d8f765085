"""Routing fidelity: does a mixture-of-experts model route decode tokens over
filled KV as it does over real prefill?

    python bench/moe_fidelity.py      # 256 held-out prompts x 256 tokens, 64 greedy tokens; bank over 128 others
    python bench/moe_fidelity.py --held-out 64 --record 16 --output-len 32 --json out/moe-fidelity-small.json

A tiny random-weight Mixtral (made once in ``out/tiny-mixtral``, see "Model")
decodes the same held-out prompts in four runs, one new engine after another in one child process:
  * ``prefill``  - no connector: vLLM computes the prompts' KV
  * ``replay``   - kvfill, ``fill_mode: replay`` from a bank recorded with real
                   prefill over *other* prompts of the same distribution (a
                   held-out prompt matches no recorded key, so it replays the
                   sequence a hash of its prompt picks; N = the prompt length,
                   so no position wraps)
  * ``normal``   - kvfill, normal(mean, std) with the mean and std of the
                   bank's real KV (measured over all its values; reported)
  * ``constant`` - kvfill, the constant 0.015 (the in-tree connector's default)
A forward hook on every MoE layer's router (``enforce_eager``: hooks do not
fire in a compiled graph) counts the top-k experts it selects for each
decode-step token (position >= the prompt length; the prompt's last token,
computed for real in every run, is not counted).  Reported per run and layer:
the normalised expert-load histogram and its total variation distance to
``prefill``'s, ``TV(p, q) = 1/2 sum_e |p_e - q_e|`` (0: the same load, 1:
disjoint); as a noise floor, the TV between ``prefill``'s loads over two
disjoint halves of the held-out prompts (half the sample each, so it is
about sqrt(2) above the sampling noise of a full-size comparison), and as a
scale, ``prefill``'s TV to the uniform load.  Writes
``bench/results/moe-fidelity-cpu.json`` and ``.png`` (TV per layer per run;
the expert loads per layer).

Model: 4 layers, hidden 256, 8 experts top-2, 4 KV heads x 64, vocabulary
1024 (the word-level tokenizer of ``kvfill.bench.models``), float32, weights
normal(0, 0.1), and one random vector of that scale added to every token
embedding.  That shared direction stands in for the common direction of a
trained model's hidden states (they are anisotropic); without it a random
router sees isotropic inputs and spreads the decode tokens of any context
evenly over the experts, and the load cannot tell one KV from another
(measured, 32 prompts x 16 tokens: prefill's TV to uniform 0.05, below the
noise floor 0.07-0.09, for weight std 0.1 and 0.2; every fill within the floor).
With it (``--shared-embedding 1``) the load is uneven and the greedy outputs
still depend on the context.

Prompts: each is a phrase of 4-16 words from a topic of 32 words, repeated to
the prompt length with a fifth of the words swapped for other words of the
topic - prompts differ from each other (uniform random words would average
out to one context), and the recorded and held-out prompts come from the same
generator with different seeds.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import re
import sys
import time

from kvfill.bench.common import child_result, print_result, run_child, run_each
from kvfill.bench.models import make_tokenizer

RUNS = ("prefill", "replay", "normal", "constant")
COLORS = {"prefill": "tab:blue", "replay": "tab:orange", "normal": "tab:green", "constant": "tab:red"}
LAYERS, HIDDEN, EXPERTS, TOP_K, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 256, 8, 2, 4, 4, 64, 1024
TOPIC_WORDS, FILL_MEAN = 32, 0.015
RECORD_SEED, HELD_OUT_SEED = 1, 2


def make_moe_model(path: str, init_std: float, shared: float) -> str:
    """A random-weight Mixtral saved to ``path`` (float32, created once): weights
    normal(0, ``init_std``), and one random vector of the same scale, times
    ``shared``, added to every token embedding (module docstring: "Model").
    The two values are kept in ``path/moe_fidelity.json``; a folder made with
    other values is an error."""
    recipe = {"init_std": init_std, "shared_embedding": shared}
    recipe_file = os.path.join(path, "moe_fidelity.json")
    if os.path.exists(os.path.join(path, "config.json")):
        if os.path.exists(recipe_file):
            with open(recipe_file) as f:
                made = json.load(f)
            if made != recipe:
                raise SystemExit(f"{path} was made with {made}, not the requested {recipe}; remove it, pass "
                                 f"those values, or give another --model")
        return path
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=4096,
        initializer_range=init_std,
    )
    model = MixtralForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight += shared * init_std * torch.randn(HIDDEN)
    model.save_pretrained(path)
    with open(recipe_file, "w") as f:
        json.dump(recipe, f)
    return path


def model_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    keys = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok",
            "initializer_range", "dtype", "torch_dtype")
    return {k: cfg[k] for k in keys if k in cfg}


def make_prompts(n: int, length: int, seed: int) -> list[str]:
    """Topic prompts (module docstring), ``length`` words each."""
    r = random.Random(seed)
    prompts = []
    for _ in range(n):
        topic = r.sample(range(3, VOCAB), TOPIC_WORDS)
        phrase = [r.choice(topic) for _ in range(r.randint(4, 16))]
        words: list[int] = []
        while len(words) < length:
            words += [w if r.random() >= 0.2 else r.choice(topic) for w in phrase]
        prompts.append(" ".join(f"w{w}" for w in words[:length]))
    return prompts


def write_lines(path: str, lines: list[str]) -> None:
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def max_model_len(a) -> int:
    """One value for the recording and every run (vLLM CPU's attention rounds
    differently with another max_model_len; see bench/replay_e2e.py)."""
    return a.prompt_len + a.output_len + 16


def bank_stats(path: str) -> dict:
    """Mean and std of the bank's real KV values (all layers; K and V apart:
    a row is ``[K/V, head, head_dim]``, so its first half is K)."""
    import torch

    from kvfill.kernels import Bank

    bank = Bank.load(path)
    k = torch.cat([t[..., : t.shape[-1] // 2].float().flatten() for t in bank.layers.values()])
    v = torch.cat([t[..., t.shape[-1] // 2 :].float().flatten() for t in bank.layers.values()])
    kv = torch.cat([k, v])
    return {"mean": kv.mean().item(), "std": kv.std().item(), "k_mean": k.mean().item(), "k_std": k.std().item(),
            "v_mean": v.mean().item(), "v_std": v.std().item(), "sequences": bank.num_sequences,
            "positions": bank.num_positions}


# ------------------------------------------------------------ inside the run's worker
def install_expert_counter(worker, num_experts: int, top_k: int) -> list[int]:
    """Hook every MoE router of the worker's model (collective_rpc); returns the
    hooked layers.  Counts land in ``worker.kvfill_expert_counts``:
    request id -> layer -> [tokens routed to each expert], decode-step tokens only."""
    from vllm.forward_context import get_forward_context

    runner = worker.model_runner
    counts: dict[str, dict[int, list[int]]] = collections.defaultdict(dict)
    worker.kvfill_expert_counts = counts

    def hook_for(layer: int):
        def hook(module, inputs, output):
            md = get_forward_context().attn_metadata
            if isinstance(md, list):
                md = md[0] if md else None
            if not md:  # a dummy run: no requests
                return
            logits = output[0] if isinstance(output, tuple) else output
            experts = logits.float().topk(top_k, dim=-1).indices.tolist()
            # Tokens are laid out request by request in the input batch's order;
            # a token is a decode step's input when its position is past its prompt.
            starts = next(iter(md.values())).query_start_loc.tolist()
            positions = runner.positions[: len(experts)].tolist()
            batch = runner.input_batch
            for i in range(len(starts) - 1):
                prompt_len = int(batch.num_prompt_tokens[i])
                row = counts[batch.req_ids[i]].setdefault(layer, [0] * num_experts)
                for t in range(starts[i], starts[i + 1]):
                    if positions[t] >= prompt_len:
                        for e in experts[t]:
                            row[e] += 1
        return hook

    layers = []
    for name, module in runner.model.named_modules():
        # Mixtral: model.layers.N.block_sparse_moe.gate.  On CPU the linear weights
        # are repacked after loading (weight is empty): match on the output size.
        if name.endswith(".gate") and getattr(module, "output_size", None) == num_experts:
            layer = int(name.split(".layers.")[1].split(".")[0])
            module.register_forward_hook(hook_for(layer))
            layers.append(layer)
    return sorted(layers)


def read_expert_counts(worker) -> dict:
    return {rid: {str(layer): row for layer, row in by_layer.items()}
            for rid, by_layer in worker.kvfill_expert_counts.items()}


# ------------------------------------------------------------ the runs (one child process)
def run_one(a, run: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the hooks live in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(a.model)
    with open(a.prompts_file) as f:
        ids = [list(tok(line.rstrip("\n")).input_ids) for line in f if line.strip()]
    extra = {"prefill": None, "replay": {"fill_mode": "replay", "bank": a.bank},
             "normal": {"fill_mean": a.fill_mean, "fill_std": a.fill_std},
             "constant": {"fill_mean": FILL_MEAN, "fill_std": 0.0}}[run]
    kw = {}
    if extra is not None:
        kw["kv_transfer_config"] = {"kv_connector": "KVFillConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": extra}
    t0 = time.perf_counter()
    llm = LLM(model=a.model, dtype=a.dtype, skip_tokenizer_init=True, enforce_eager=True,
              max_model_len=max_model_len(a), max_num_batched_tokens=max(2048, a.prompt_len + 16),
              max_num_seqs=len(ids), disable_log_stats=True, enable_prefix_caching=False, seed=0, **kw)
    startup_s = time.perf_counter() - t0
    hooked = llm.collective_rpc(install_expert_counter, args=(EXPERTS, TOP_K))[0]
    if len(hooked) != LAYERS:
        raise RuntimeError(f"hooked the routers of layers {hooked}; expected {LAYERS} MoE layers")
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=t) for t in ids], params, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    # The engine's request ids are the outputs' with a random suffix ("3-1f2e...").
    counts = {rid.rsplit("-", 1)[0]: c for rid, c in llm.collective_rpc(read_expert_counts)[0].items()}
    zeros = {str(layer): [0] * EXPERTS for layer in range(LAYERS)}
    per_prompt = [counts.get(o.request_id, zeros) for o in outs]  # outputs come in prompt order
    routed = sum(sum(c[str(layer)]) for c in per_prompt for layer in range(LAYERS))
    expected = len(ids) * (a.output_len - 1) * LAYERS * TOP_K  # the last sampled token is never an input
    if routed != expected:
        raise RuntimeError(f"counted {routed} expert selections over decode-step tokens; expected prompts x "
                           f"(output_len - 1) x layers x top-k = {expected}")
    del llm
    return {"run": run, "startup_s": round(startup_s, 1), "generate_s": round(generate_s, 2),
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "counts": [[c[str(layer)] for layer in range(LAYERS)] for c in per_prompt]}


# ------------------------------------------------------------ analysis
def load(counts_per_prompt: list, prompts: range | list) -> list[list[float]]:
    """Normalised expert load per layer, summed over the given prompts."""
    out = []
    for layer in range(LAYERS):
        total = [sum(counts_per_prompt[p][layer][e] for p in prompts) for e in range(EXPERTS)]
        n = sum(total)
        out.append([x / n if n else 0.0 for x in total])
    return out


def tv(p: list[float], q: list[float]) -> float:
    return 0.5 * sum(abs(x - y) for x, y in zip(p, q))


def equal_tokens(ref: list[list[int]], other: list[list[int]]) -> str:
    same = sum(x == y for r, o in zip(ref, other) for x, y in zip(r, o))
    return f"{same}/{sum(len(r) for r in ref)}"


def plot(rows: list[dict], loads: dict, floor: list[float], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 1 + LAYERS, figsize=(4 * (1 + LAYERS), 3.8))
    ax = axes[0]
    others = [r["run"] for r in rows]
    width = 0.8 / len(others)
    for i, run in enumerate(others):
        ax.bar([layer + (i - (len(others) - 1) / 2) * width for layer in range(LAYERS)],
               next(r for r in rows if r["run"] == run)["tv_per_layer"], width, label=run, color=COLORS[run])
    ax.plot(range(LAYERS), floor, "k_", markersize=22, mew=2, label="noise floor (halves)")
    ax.set_xticks(range(LAYERS))
    ax.set_xlabel("layer")
    ax.set_ylabel("TV distance to prefill")
    ax.set_title("expert load vs real prefill")
    ax.set_ylim(0, 1.3 * max(max(r["tv_per_layer"]) for r in rows))
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    width = 0.8 / len(loads)
    for layer, ax in enumerate(axes[1:]):
        for i, (run, per_layer) in enumerate(loads.items()):
            ax.bar([e + (i - (len(loads) - 1) / 2) * width for e in range(EXPERTS)], per_layer[layer], width,
                   label=run, color=COLORS[run])
        ax.axhline(1 / EXPERTS, color="k", lw=0.7, ls=":")
        ax.set_xticks(range(EXPERTS))
        ax.set_xlabel("expert")
        ax.set_title(f"layer {layer}: decode-token load")
        if layer == 0:
            ax.set_ylabel("share of top-k selections")
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--held-out", type=int, default=256, help="prompts decoded in every run")
    p.add_argument("--record", type=int, default=128,
                   help="other prompts the replay bank is recorded over (replay's load averages over this many "
                        "contexts: fewer add their own sampling noise)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--init-std", type=float, default=0.1,
                   help="the model's weight std (initializer_range), when it is made")
    p.add_argument("--shared-embedding", type=float, default=1.0,
                   help="scale of the direction shared by every token embedding, when the model is made "
                        "(module docstring: 0 makes the load uniform whatever the KV)")
    p.add_argument("--model", default=None, help="model folder (default out/tiny-mixtral, made if missing)")
    p.add_argument("--dtype", default="float32", help="model and KV dtype, for the recording and every run")
    p.add_argument("--timeout", type=float, default=600, help="seconds per subprocess")
    p.add_argument("--json", default=None, help="default bench/results/moe-fidelity-cpu.json (and .png beside it)")
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)
    p.add_argument("--bank", default=None, help=argparse.SUPPRESS)
    p.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)
    p.add_argument("--fill-mean", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--fill-std", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    out_dir = os.path.join(here, "..", "out", "moe-fidelity")
    a.model = os.path.abspath(a.model or os.path.join(here, "..", "out", "tiny-mixtral"))
    if a.only:
        print_result(run_each(a.only, lambda run: run_one(a, run)))
        return 0
    t_start = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    make_tokenizer(make_moe_model(a.model, a.init_std, a.shared_embedding))
    record_prompts = make_prompts(a.record, a.prompt_len, RECORD_SEED)
    held_out = make_prompts(a.held_out, a.prompt_len, HELD_OUT_SEED)
    if set(record_prompts) & set(held_out):
        raise SystemExit("a held-out prompt equals a recorded one; change the seeds")
    record_file, held_out_file = os.path.join(out_dir, "record-prompts.txt"), os.path.join(out_dir, "prompts.txt")
    write_lines(record_file, record_prompts)
    write_lines(held_out_file, held_out)
    bank = os.path.join(out_dir, "bank.safetensors")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    record_cmd = [sys.executable, "-m", "kvfill.record", "--model", a.model, "--prompts", record_file, "--out", bank,
                  "--positions", str(a.prompt_len), "--dtype", a.dtype, "--max-model-len", str(max_model_len(a))]
    print(f"recording {a.record} prompts ...", flush=True)
    rec = run_child(record_cmd, "recording", timeout=a.timeout, env=env)
    print(next(line for line in rec.stdout.splitlines() if line.startswith("wrote")), flush=True)
    stats = bank_stats(bank)
    a.fill_mean, a.fill_std = stats["mean"], stats["std"]
    from transformers import AutoTokenizer

    from kvfill.bank import BankIndex

    tok = AutoTokenizer.from_pretrained(a.model)
    index = BankIndex.read(bank)
    replayed = [index.sequence_for(tok(line).input_ids) for line in held_out]
    print(f"real KV in the bank: mean {stats['mean']:.4f}, std {stats['std']:.4f} (K std {stats['k_std']:.4f}, "
          f"V std {stats['v_std']:.4f}); normal fill: the same mean and std; the held-out prompts "
          f"replay {len(set(replayed))} of the {index.num_sequences} recorded sequences", flush=True)

    cmd = [sys.executable, os.path.abspath(__file__), "--only", ",".join(RUNS), "--bank", bank, "--prompts-file",
           held_out_file, "--model", a.model, "--dtype", a.dtype, "--prompt-len", str(a.prompt_len),
           "--output-len", str(a.output_len), "--fill-mean", repr(a.fill_mean), "--fill-std", repr(a.fill_std)]
    commands = {"runs": cmd}
    print(f"running {', '.join(RUNS)} (one engine after another, one process) ...", flush=True)
    results = child_result(cmd, "the runs", timeout=a.timeout * len(RUNS), env=env)

    prompts = range(a.held_out)
    loads = {run: load(results[run]["counts"], prompts) for run in RUNS}
    ref = loads["prefill"]
    halves = (load(results["prefill"]["counts"], prompts[0::2]), load(results["prefill"]["counts"], prompts[1::2]))
    floor = [tv(x, y) for x, y in zip(*halves)]
    uniform = [tv(ref[layer], [1 / EXPERTS] * EXPERTS) for layer in range(LAYERS)]
    decode_tokens = sum(sum(results["prefill"]["counts"][i][0]) for i in prompts) // TOP_K
    rows = []
    for run in RUNS[1:]:
        per_layer = [tv(ref[layer], loads[run][layer]) for layer in range(LAYERS)]
        rows.append({"run": run, "tv_per_layer": per_layer, "tv_mean": sum(per_layer) / LAYERS,
                     "tokens_equal_to_prefill": equal_tokens(results["prefill"]["tokens"], results[run]["tokens"])})
    references = [{"run": "noise floor: prefill, half vs half", "tv_per_layer": floor, "tv_mean": sum(floor) / LAYERS},
                  {"run": "scale: prefill vs uniform load", "tv_per_layer": uniform, "tv_mean": sum(uniform) / LAYERS}]

    from kvfill.bench.common import table

    def show(r: dict) -> dict:
        shown = {"run": r["run"], "mean": f"{r['tv_mean']:.3f}",
                 "tokens_equal_to_prefill": r.get("tokens_equal_to_prefill", "")}
        shown.update({f"layer {layer}": f"{x:.3f}" for layer, x in enumerate(r["tv_per_layer"])})
        return shown

    print(f"\n{a.held_out} held-out prompts x {a.prompt_len} tokens, {a.output_len} greedy tokens "
          f"({decode_tokens} decode-step tokens per layer, top-{TOP_K} of {EXPERTS} experts); replay bank recorded over "
          f"{a.record} other prompts; model {os.path.basename(a.model)}, {a.dtype}")
    print("total variation distance of the decode-token expert load to real prefill's:")
    print(table([show(r) for r in rows + references],
                ["run"] + [f"layer {layer}" for layer in range(LAYERS)] + ["mean", "tokens_equal_to_prefill"]))

    import vllm

    path = os.path.abspath(a.json or os.path.join(here, "results", "moe-fidelity-cpu.json"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    payload = {
        "machine": {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "vllm": vllm.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python bench/moe_fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "record_command": record_cmd, "run_commands": commands,
        "args": {k: v for k, v in vars(a).items() if k not in ("only", "bank", "prompts_file")},
        "model_config": model_config(a.model),
        "prompts": {"held_out": a.held_out, "record": a.record, "prompt_len": a.prompt_len,
                    "output_len": a.output_len, "topic_words": TOPIC_WORDS, "record_seed": RECORD_SEED,
                    "held_out_seed": HELD_OUT_SEED, "decode_tokens_per_layer": decode_tokens,
                    "recorded_sequences_replayed": len(set(replayed))},
        "bank_kv_stats": stats,
        "fills": {"normal": {"fill_mean": a.fill_mean, "fill_std": a.fill_std},
                  "constant": {"fill_mean": FILL_MEAN, "fill_std": 0.0}},
        "rows": rows, "references": references,
        "expert_load": {run: [[round(x, 5) for x in row] for row in per_layer] for run, per_layer in loads.items()},
        "timings": {run: {"startup_s": results[run]["startup_s"], "generate_s": results[run]["generate_s"]}
                    for run in RUNS},
        "counts_per_prompt": {run: results[run]["counts"] for run in RUNS},  # [prompt][layer][expert]
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    text = json.dumps(payload, indent=1)
    # Lists of numbers on one line each: the counts are [prompt][layer][expert].
    text = re.sub(r"\[\s*([-+0-9.e,\s]+?)\s*\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    with open(path, "w") as f:
        f.write(text + "\n")
    png = path.removesuffix(".json") + ".png"
    try:
        plot(rows, loads, floor, png, f"tiny Mixtral ({LAYERS} layers, {EXPERTS} experts top-{TOP_K}): "
             f"{a.held_out} prompts x {a.prompt_len} tokens, {a.output_len} decode tokens, {a.dtype}")
        print(f"wrote {path} and {png}")
    except ImportError:
        print(f"wrote {path} (no matplotlib: pip install -e '.[bench]' for the plot)")
    print(f"wall {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
