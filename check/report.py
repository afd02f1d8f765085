"""kvfill-check's one report writer: ``report.json``, ``report.md`` and
``report.png`` in ``--out``, around the verdict lines (``verdict.py``) -
and who may write there: one check at a time (``holding``), an earlier
check's report gone before this one's first step (``clear``), a stopped
check's report marked partial, and vLLM's warnings that bear on timing
carried from the steps' logs (``timing_warnings``).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import re

from . import classes
from .compare import REFERENCE
from .verdict import _pct, time_class, time_host_line

# Per-token and per-prompt lists a run measured (and each class's timed passes): in OUT/logs/RUN.json,
# summarised in report.json (--serve: the client's own file, OUT/logs/served-RUN.json)
RAW = ("greedy", "eos", "expert_counts", "texts", "timing_by_class")
REPORTS = ("report.json", "report.md", "report.png")
LOCK = ".kvfill-check.lock"  # in --out: flock'ed by the check writing there, holding its pid
# vLLM's log line: "(EngineCore pid=1) WARNING 05-12 17:35:47 [cpu_worker.py:131] the message"
VLLM_WARNING = re.compile(r"\bWARNING \d\d-\d\d [\d:]+ \[[^\]]*\] (.+)")
TIMING_WORDS = ("performance", "slow", "degrad", "sub-optimal", "suboptimal")  # a warning that says timing suffers


@contextlib.contextmanager
def holding(out: str):
    """``out`` for this check alone while the block runs: an exclusive
    flock on ``OUT/.kvfill-check.lock``, which Linux drops when this
    process ends however it ends, holding this process's pid for a second
    check to name; that one gets CheckError naming the folder and the pid.
    A folder made here that holds nothing else when the block ends (a
    refusal before anything was written) is removed again."""
    made = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by the steps (Python's default)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "not written yet"
        os.close(fd)
        from .cli import CheckError

        raise CheckError(f"--out {out!r} is in use by another kvfill-check (pid {holder}) writing its report there; "
                         f"expected an --out no running check holds (another folder, or this one once pid {holder} "
                         f"has ended)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    try:
        yield
    finally:
        if made and os.listdir(out) == [LOCK]:
            with contextlib.suppress(OSError):
                os.unlink(path)
                os.rmdir(out)
        os.close(fd)


def clear(out: str) -> None:
    """An earlier check's report in ``out``, removed before this check's
    first step: a rerun stopped before its own report would otherwise leave
    that one in place, read as this run's."""
    for name in REPORTS:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(out, name))


def timing_warnings(paths: list[str]) -> list[dict]:
    """vLLM's warnings in these logs that say timing suffers (performance
    lost, slow, degraded, sub-optimal: e.g. speculative decoding on CPU
    without Intel OpenMP), each once: ``{"warning": text, "logs": [the
    logs' names that hold it]}``."""
    found: dict[str, list[str]] = {}
    for path in paths:
        with open(path, errors="replace") as f:
            for line in f:
                m = VLLM_WARNING.search(re.sub(r"\x1b\[[0-9;]*m", "", line))  # colours, where vLLM forced them
                if m and any(w in m.group(1).lower() for w in TIMING_WORDS):
                    logs = found.setdefault(m.group(1).strip(), [])
                    logs += [os.path.basename(path)] if os.path.basename(path) not in logs else []
    return [{"warning": text, "logs": logs} for text, logs in found.items()]


def write(out: str, cfg, res: dict, cmp: dict, lines: list[str]) -> list[str]:
    """report.json, report.md and report.png in ``out``; their paths."""
    paths = [os.path.join(out, f"report.{ext}") for ext in ("json", "md", "png")]
    steps = {run: {k: v for k, v in step.items() if k not in RAW} for run, step in res["steps"].items()}
    payload = {"command": ["kvfill-check", *cfg.argv], "model": cfg.model, "engine_flags": _jsonable(cfg.engine),
               "verdicts": lines, "comparison": cmp, **res, "steps": steps,
               "raw": {run: os.path.join(out, "logs", f"{run}.json") for run in steps if "error" not in steps[run]}}
    text = json.dumps(_finite(payload), indent=1, default=str, allow_nan=False)
    # lists of numbers on one line each (tokens, logprobs, expert counts)
    text = re.sub(r"\[\s*([-+0-9.e,\s]+?)\s*\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    with open(paths[0], "w") as f:
        f.write(text + "\n")
    with open(paths[1], "w") as f:
        f.write(markdown(cfg, res, cmp, lines))
    if "reference_failed" in cmp:
        paths[2] = "no report.png (real prefill failed: nothing to compare)"
    elif not plot(paths[2], res, cmp, os.path.basename(os.path.normpath(cfg.model))):
        paths[2] = "no report.png (matplotlib is not installed: pip install 'kvfill[bench]')"
    if paths[2].startswith("no ") and os.path.exists(os.path.join(out, "report.png")):
        os.remove(os.path.join(out, "report.png"))  # an earlier check's, beside this one's report
    return paths


def _finite(obj):
    """``obj`` with each NaN or infinite float as its name (strict JSON has no such number)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _jsonable(engine: dict) -> dict:
    return {k: v if isinstance(v, (str, int, float, bool, list, dict, type(None))) else str(v)
            for k, v in engine.items()}


def _held(res: dict) -> str:
    held = res.get("bank_prompts_held")
    return "" if held is None else f" (holding {held}/{len(res['prompt_tokens'])} prompts whole)"


def _eos_run(cfg) -> str:
    if not cfg.max_tokens:
        return "no EOS-honoured run (--max-tokens 0)"
    if cfg.serve:
        how = f"at temperature {cfg.temperature:g}" if cfg.temperature else "greedy"
        return (f"EOS-honoured run served (vllm serve + vllm bench serve, concurrency "
                f"{cfg.concurrency or 'every prompt'}) up to {cfg.max_tokens} tokens, {how}")
    how = f"at temperature {cfg.temperature:g}, each prompt its own seed" if cfg.temperature else "greedy"
    return f"EOS-honoured run up to {cfg.max_tokens} tokens, {how}"


def _setting_lines(cfg, res: dict) -> list[str]:
    """What the runs were given that the user did not choose: each engine's
    KV space (vLLM CPU), the normal fill's mean and std and where they come
    from."""
    out = []
    kv = res.get("kv_space")
    if kv:
        out.append(f"- KV space per engine (vLLM CPU): {kv['gib']} GiB - {kv['source']}")
    normal = (res.get("fills") or {}).get("normal")
    if normal:
        stats = res.get("bank_stats")
        why = ("--normal" if cfg.normal else f"the bank's KV values: {stats['source']}" if stats and stats.get("source")
               else "the bank's KV values" if stats else
               "N(0, 1): the bank holds no float KV rows to take a spread from")
        out.append(f"- normal fill: mean {normal['fill_mean']:.4g}, std {normal['fill_std']:.4g} - {why}")
    if res.get("prompt_classes") and getattr(cfg, "time_by_class", "on") == "off" and cfg.time_passes:
        out.append("- decode time per class: not measured (--time-by-class off: the whole run's passes only)")
    return out + [""] if out else []


def _partial_lines(res: dict) -> list[str]:
    """A stopped check's report says so first, and what it did not measure."""
    partial = res.get("partial")
    if not partial:
        return []
    return [f"**Partial report**: the check was stopped by {partial['stopped_by']} before it ended; measured: "
            f"{', '.join(partial['measured']) or 'nothing'}; not measured: {', '.join(partial['not_measured'])} "
            f"(their lines below say \"not run\").", ""]


def _warning_lines(res: dict) -> list[str]:
    """vLLM's warnings that bear on the timings (``timing_warnings``), each once."""
    found = res.get("timing_warnings")
    if not found:
        return []
    return ["## vLLM's warnings that bear on timing", "",
            *[f"- {w['warning']} ({', '.join(w['logs'])})" for w in found], ""]


def _runners(res: dict) -> str:
    """"; vLLM's model runner V2" (each run's, as its worker reported it; several when runs differ)."""
    seen = sorted({s["model_runner"] for s in res["steps"].values() if s.get("model_runner")})
    return f"; vLLM's model runner {' and '.join(seen)}" if seen else ""


def markdown(cfg, res: dict, cmp: dict, lines: list[str]) -> str:
    out = [f"# kvfill-check: {os.path.basename(os.path.normpath(cfg.model))}", "",
           f"`kvfill-check {' '.join(cfg.argv)}`", "",
           f"{len(res['prompt_tokens'])} prompts of {min(res['prompt_tokens'])}-{max(res['prompt_tokens'])} tokens; "
           f"{cfg.output_len} greedy tokens (EOS ignored); "
           f"{_eos_run(cfg)}; bank {'recorded over these prompts' if res['bank_recorded'] else res['bank']}"
           f"{_held(res)}"
           f"; {res['runtime_s']:.0f} s in all{_runners(res)}.", "", *_partial_lines(res), *_setting_lines(cfg, res),
           *_warning_lines(res), "## Verdicts", ""]
    out += [f"- {line}" for line in lines]
    served = " served req/s | served TPOT ms |" if cfg.serve else ""
    _, band = time_host_line(cmp.get(REFERENCE, {}).get("decode_time"))
    out += ["", "## Runs", "", "Decode time: ms per request-token (median of the timed passes' pure decode steps), the "
            "ratio to real prefill timed in the same engine with its 95 % interval, the host's 1-minute load over "
            "the passes and the process's CPU seconds per wall second; after the interval, what it shows against "
            "the host's band: differs, within, or not measurable (n.m.: thin, or reaching past the band).", "",
            "| run | tokens = real | EOS mean length | at EOS | acceptance | expert TV | "
            f"decode ms/token | ratio [95 %] | load | CPU/wall | run s |{served}",
            "|---|---|---|---|---|---|---|---|---|---|---|" + "---|---|" * cfg.serve]
    for run, step in res["steps"].items():
        if "error" in step:
            out.append(f"| {run} | failed | | | | | | | | | {step.get('step_s', '')} |" + " | |" * cfg.serve)
            continue
        row = cmp.get(run, {})
        t = row.get("tokens") or row.get("tokens_vs_prefill")
        e, s = row.get("eos"), row.get("spec")
        tv = (row.get("expert_load") or {}).get("tv_mean", (row.get("moe_floor") or {}).get("tv_mean"))
        tok = f"{t['equal']}/{t['total']}" if t else ("reference" if run == REFERENCE else "")
        tv_cell = "" if tv is None else (f"floor {tv}" if run == REFERENCE else tv)
        out.append(f"| {run} | {tok} | {e['mean'] if e else ''} | {_pct(e['eos_share']) if e else ''} "
                   f"| {_pct(s['acceptance']) if s else ''} | {tv_cell} | {_time_cells(row.get('decode_time'), band)} "
                   f"| {step.get('step_s', '')} |" + (_served_cells(step) if cfg.serve else ""))
    out += classes.class_table(cmp, band, time_class)
    out += classes.class_table(cmp, band, time_class, "by_depth")
    if res.get("samples"):
        out += ["", "## What each run wrote", "", "The first prompt's first greedy tokens:", "",
                "| run | text |", "|---|---|"]
        out += [f"| {run} | {json.dumps(text, ensure_ascii=False)[1:-1].replace('|', '¦')} |"
                for run, text in res["samples"].items()]
    return "\n".join(out) + "\n"


def _time_cells(t: dict | None, band: float) -> str:
    """decode ms/token | ratio [95 %] and what it shows | load | CPU/wall (real prefill's row: against itself)."""
    if not t or "ratio" not in t:
        return " | | | "
    kind, why = time_class(t, band)
    shows = {"differs": "differs", "within": "within"}.get(kind, "n.m." + (" (thin)" if why.startswith("thin") else ""))
    return (f"{t['ms_per_token'][0]:.3g} | {t['ratio']:g} [{t['interval'][0]:g}, {t['interval'][1]:g}] {shows} | "
            f"{t['load'][0]:g}-{t['load'][1]:g} | {t['cpu_per_wall']:g}")


def _served_cells(step: dict) -> str:
    s = step.get("served")
    if s:
        return f" {s['request_throughput']:.3g} | {s['mean_tpot_ms']:.3g} |"
    return " failed | |" if step.get("served_error") else " | |"  # the recording and the split are not served


_RUN_COLOURS = {REFERENCE: "tab:blue", "replay": "tab:orange", "normal": "tab:green", "constant": "tab:purple",
                "zeros": "tab:gray"}


def depth_curves(res: dict, cmp: dict) -> list[tuple[str, dict]]:
    """``--depths``' curves: (panel title, run -> (depths in tokens, values))
    for acceptance and the EOS-honoured mean output length against depth,
    every run on one axis (none without --depths, or without drafts / an
    EOS-honoured run)."""
    per, depths = cmp.get("by_depth"), res.get("depths")
    if not per or not depths:
        return []
    labels = [d for d in depths if d in per]
    out = []
    for name, value in (("acceptance (%) vs depth", lambda row: 100 * row["spec"]["acceptance"]
                         if row.get("spec") else None),
                        ("EOS-honoured mean output length vs depth", lambda row: row["eos"]["mean"]
                         if row.get("eos") else None)):
        lines = {}
        for run in dict.fromkeys(r for d in labels for r in per[d]):
            pts = [(depths[d], value(per[d][run])) for d in labels if run in per[d]]
            pts = [(x, y) for x, y in pts if y is not None]
            if pts:
                lines[run] = ([x for x, _ in pts], [y for _, y in pts])
        if lines:
            out.append((name, lines))
    return out


def draw_depth_curves(ax, title: str, lines: dict, depths: dict) -> None:
    """One of ``depth_curves``' panels on ``ax``: every run's line against
    depth (log scale, ticked at ``depths``: label -> tokens)."""
    for run, (xs, ys) in lines.items():
        ax.plot(xs, ys, marker="o", ms=3, label=run, lw=2.2 if run == REFERENCE else 1.2,
                color=_RUN_COLOURS.get(run), ls="-" if run in (REFERENCE, "replay") else "--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(depths.values()), list(depths), fontsize=7)
    ax.set_xlabel("prompt depth (tokens)", fontsize=7)
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=6)


def plot(path: str, res: dict, cmp: dict, title: str) -> bool:
    """Tokens equal, EOS lengths, acceptance, expert TV, decode time per run; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = [r for r in res["steps"] if r not in ("record", "prefill_split") and r in cmp]
    panels = [("greedy tokens = real prefill's (%)",
               lambda r: 100.0 if r == REFERENCE else 100 * cmp[r]["tokens"]["share"])]
    if cmp.get(REFERENCE, {}).get("eos"):
        panels.append(("EOS-honoured mean output length", lambda r: (cmp[r].get("eos") or {}).get("mean", 0.0)))
    if cmp.get(REFERENCE, {}).get("spec"):
        panels.append(("acceptance (%)", lambda r: 100 * (cmp[r]["spec"] or {"acceptance": 0})["acceptance"]))
    if cmp.get(REFERENCE, {}).get("moe_floor"):
        panels.append(("expert load TV to real prefill (line: floor)",
                       lambda r: 0.0 if r == REFERENCE else cmp[r].get("expert_load", {}).get("tv_mean", 0.0)))
    if cmp.get(REFERENCE, {}).get("served"):
        panels.append(("served requests/s", lambda r: (cmp[r].get("served") or {}).get("request_throughput") or 0.0))
    _, band = time_host_line(cmp.get(REFERENCE, {}).get("decode_time"))
    panels.append((f"decode time / real prefill\n(bar: 95 %; green: host resolves {band:.2g}x)",
                   lambda r: (cmp[r].get("decode_time") or {}).get("ratio", 0.0)))
    curves = depth_curves(res, cmp)
    cols = max(len(panels), len(curves))
    fig, axes = plt.subplots(1 + bool(curves), cols, figsize=(3.2 * cols, 3.2 * (1 + bool(curves))), squeeze=False)
    for ax in list(axes[0][len(panels):]) + (list(axes[1][len(curves):]) if curves else []):
        ax.set_visible(False)
    for ax, (name, lines) in zip(axes[1] if curves else (), curves):
        draw_depth_curves(ax, name, lines, res["depths"])
    for ax, (name, value) in zip(axes[0], panels):
        bars = ax.bar(runs, [value(r) for r in runs], color=["tab:blue" if r == REFERENCE else "tab:orange"
                                                             if r == "replay" else "tab:gray" for r in runs])
        if name.startswith("expert"):
            ax.axhline(cmp[REFERENCE]["moe_floor"]["tv_mean"], color="k", ls="--", lw=1)
            for bar, r in zip(bars, runs):  # the per-layer count the verdict rests on
                x = cmp[r].get("expert_load") or {}
                if "layers" in x:
                    ax.annotate(f"{x['layers_above_floor']}/{x['layers']}", (bar.get_x() + bar.get_width() / 2,
                                bar.get_height()), ha="center", va="bottom", fontsize=7)
        if name.startswith("decode"):
            ax.axhline(1.0, color="k", ls="--", lw=1)
            ax.axhspan(1 / band, band, color="tab:green", alpha=0.12, lw=0)  # what this host resolves
            for i, r in enumerate(runs):
                t = cmp[r].get("decode_time") or {}
                if "interval" in t:
                    ax.plot([i, i], t["interval"], color="k", lw=1.5)
                    kind, why = time_class(t, band)
                    label = {"differs": "differs", "within": "ok"}.get(kind, "thin" if why.startswith("thin")
                                                                       else "n.m.")
                    ax.annotate(label, (i, min(t["interval"][1], 3 * band)), ha="center", va="bottom", fontsize=7)
            ax.set_ylim(0, max([3 * band] + [min(3 * band, (cmp[r].get("decode_time") or {}).get("ratio", 0) * 1.2)
                                             for r in runs]))
        ax.set_title(name, fontsize=8)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.suptitle(f"kvfill-check: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
