"""Stored kvfill-check reports judged again by today's rules
(``bench/fidelity.py --rejudge``): what can be recomputed from what a
report stores is, what cannot is kept with the commit that judged it.
Not in ``classes``: it needs ``compare``, which needs ``classes``."""
from __future__ import annotations

from .compare import spec


def rejudge(cmp: dict, output_len: int, stored_by: str) -> list[str]:
    """A stored report's per-class figures by today's rules, from what it
    stores (``bench/fidelity.py --rejudge``): tokens per step over every
    step (its counts are the drafts': exact), the EOS floor per class.  A
    decode time whose passes gained more than one token a step is not
    recomputable (its passes are in the run's logs, not the report): kept
    as ``stored`` with the commit that judged it, never judged again.  What
    could not be recomputed."""
    lost = []
    for c, runs in (cmp.get("by_class") or {}).items():
        for run, row in runs.items():
            s, d = row.get("spec"), row.get("decode_time") or {}
            if s:
                row["spec"] = spec({"num_drafts": s["drafts"], "num_draft_tokens": s["draft_tokens"],
                                    "num_accepted_tokens": s["accepted"]}, row["prompts"] * (output_len - 1))
            if "ratio" in d and set(d["tokens_per_step"]) != {1.0}:  # divided by more than one token a step
                row["decode_time"] = {"kinds": d["kinds"], "stored": d, "judged_by": stored_by,
                                      "error": f"its passes are not stored; {stored_by}'s code judged {d['ratio']:g}x "
                                               f"over tokens per drafted step"}
                lost.append(f"class {c}'s {run} decode time")
            if run == "prefill":  # the whole run's floor, as compare.by_class gives it
                row["eos_floor"] = cmp["prefill"].get("eos_floor") if row.get("eos") else None
    return lost
