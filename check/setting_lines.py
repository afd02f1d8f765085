"""kvfill-check's lines about what the runs were given rather than what
they did (``verdict.py`` writes the rest): where replay's rows came from
position by position, the prefix cache's reuse after decoys, and the
sparse-attention indexer, which no engine here measures."""
from __future__ import annotations


def indexer_line(res: dict) -> str:
    """The sparse-attention indexer observable: never measured in an engine yet, and why."""
    if not res.get("indexer"):
        return "indexer top-k: not measured - the model has no sparse-attention indexer"
    return ("indexer top-k: not measured - vLLM CPU does not run sparse attention, and the check does not yet hook "
            "the indexer of a GPU engine; bench/indexer_scores.py measures each fill's top-k agreement on vLLM "
            "CPU's indexer ops")


def decoy_line(res: dict) -> str:
    """``--decoys``: how many prompt tokens each run found cached (vLLM's
    prefix-cache hits), in its engine and, with ``--serve``, on its server."""
    ran = {run: step for run, step in res["steps"].items() if run not in ("record", "prefill_split") and
           "error" not in step}
    hits = {run: step.get("counters", {}).get("prefix_cache_hit_tokens") for run, step in ran.items()}
    served = {f"{run} served": step["served"].get("prefix_cache_hit_tokens") for run, step in ran.items()
              if "served" in step}
    line = (f"prefix caching: after unrecorded decoys sharing each prompt's first {res['decoys']} tokens, cached "
            f"tokens reused - " + ", ".join(f"{run} {n}" for run, n in {**hits, **served}.items()))
    unused = [run for run, n in {**hits, **served}.items() if not n]
    return line + (f" (no reuse in {', '.join(unused)}: a block size above --decoys? nothing shown about reuse "
                   f"there)" if unused else "")


def run_coverage_lines(res: dict, run: str, prompts: int, ev) -> list[str]:
    """``coverage_lines`` of a replay run - ``replay``, or an ``--also-replay``
    run (``check/replays.py``) - from its own bank's coverage or replay's
    (``res["replay_coverage"]``, ``res["bank_coverage"]``); none for any other run."""
    own = (res.get("fills") or {}).get(run) or {}
    if run != "replay" and own.get("fill_mode") != "replay":
        return []
    cov = (res.get("replay_coverage") or {}).get(run, res.get("bank_coverage"))
    return coverage_lines(cov, prompts, ev, run, own.get("past_bank", "wrap"))


def coverage_lines(cov: dict | None, prompts: int, ev, run: str = "replay", past_bank: str = "wrap") -> list[str]:
    """What a replay run wrote, by where its rows came from (``inputs.bank_coverage``):
    positions past a recorded sequence's length wrap - a repeated context,
    not the prompt's, so the run is not shown valid there whatever the tokens
    say (``ev``: its ``verdict.Evidence``), its keys rotated for the row's
    position, or re-rotated to their own (``past_bank``); positions of another
    recorded text are named (a bank over other prompts: the moe preset's)."""
    if not cov:
        return []
    lines, total = [], cov["positions"]
    keys = "keys re-rotated to position t" if past_bank == "rotate" else "keys rotated for position t mod N"
    if cov["other"]:
        lines.append(f"{run}: {cov['other']} of the {total} filled positions replay another recorded text's rows "
                     f"(a sequence whose tokens differ there, picked by the block's token hash), so those prompts' "
                     f"tokens need not be real prefill's")
    if cov["wrapped"]:
        lines.append(f"{run}: {cov['wrapped']} of the {total} filled positions ({cov['prompts_wrapped']} of {prompts} "
                     f"prompts) lie past their recorded sequence's length (the longest holds "
                     f"{cov['longest_sequence']}) and wrap: they replay it again from its start (row t mod N, {keys}), "
                     f"so decode reads a short text repeated, not the prompt - record prompts as long as the "
                     f"benchmark's")
        ev.unknown.append(f"{cov['wrapped']} of {total} filled positions wrapped past the bank's sequences")
    return lines
