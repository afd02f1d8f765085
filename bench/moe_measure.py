"""Routing fidelity, the measuring half of bench/moe_fidelity.py: the tiny
Mixtral and its topic prompts, the bank's KV statistics, and one run (a new
engine in the child process) whose hook on every MoE router counts the
experts each decode-step token is routed to.
"""
from __future__ import annotations

import collections
import json
import os
import random
import time

RUNS = ("prefill", "replay", "normal", "constant")
LAYERS, HIDDEN, EXPERTS, TOP_K, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4, 256, 8, 2, 4, 4, 64, 1024
TOPIC_WORDS, FILL_MEAN = 32, 0.015
RECORD_SEED, HELD_OUT_SEED = 1, 2


def make_moe_model(path: str, init_std: float, shared: float) -> str:
    """A random-weight Mixtral saved to ``path`` (float32, created once): weights
    normal(0, ``init_std``), and one random vector of the same scale, times
    ``shared``, added to every token embedding (bench/moe_fidelity.py's
    docstring: "Model").  The two values are kept in ``path/moe_fidelity.json``;
    a folder made with other values is an error."""
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
    """Topic prompts (bench/moe_fidelity.py's docstring: "Prompts"),
    ``length`` words each."""
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
