"""Turn a pytest-benchmark JSON of bench/test_bench_fill.py into the report.

    python bench/report.py RAW.json [--out bench/results/cpu-bench]

Writes ``OUT.json`` (machine, versions, command, date, one row per case:
median ms, GB/s and % of memset for kvfill and the in-tree path, kvfill's
speedup, calls per step, peak extra device memory) and ``OUT.png`` (GB/s vs
fill size per implementation and mode, the memset line drawn), and prints the
table.
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

from kvfill.bench import common as C  # noqa: E402

COLUMNS = ["sweep", "case", "mode", "kvfill ms", "kvfill GB/s", "kvfill %memset", "in-tree ms",
           "in-tree %memset", "x in-tree", "kvfill calls", "in-tree calls", "kvfill extra MiB",
           "in-tree extra MiB"]


def summarize(raw: dict) -> list[dict]:
    cases: dict[tuple, dict] = defaultdict(dict)
    for b in raw["benchmarks"]:
        e = b["extra_info"]
        cases[(e["sweep"], e["case"], e["mode"])][e["impl"]] = (b["stats"]["median"], e)
    rows = []
    for (sweep, case, mode), impls in cases.items():
        if not {"kvfill", "in-tree", "memset"} <= impls.keys():
            continue
        (t_kv, e_kv), (t_in, e_in), (t_ms, _) = impls["kvfill"], impls["in-tree"], impls["memset"]
        nbytes = e_kv["bytes"]

        def mib(x):
            return "" if x is None else round(x / 2**20, 2)

        rows.append({
            "sweep": sweep, "case": case, "mode": mode, "bytes": nbytes,
            "kvfill ms": round(t_kv * 1e3, 3), "kvfill GB/s": round(C.gbps(nbytes, t_kv), 2),
            "kvfill %memset": round(100 * t_ms / t_kv, 1),
            "in-tree ms": round(t_in * 1e3, 3), "in-tree GB/s": round(C.gbps(nbytes, t_in), 2),
            "in-tree %memset": round(100 * t_ms / t_in, 1),
            "memset GB/s": round(C.gbps(nbytes, t_ms), 2),
            "x in-tree": round(t_in / t_kv, 2),
            "kvfill calls": e_kv["calls"], "in-tree calls": e_in["calls"],
            "kvfill extra MiB": mib(e_kv.get("extra_bytes")), "in-tree extra MiB": mib(e_in.get("extra_bytes")),
        })
    return rows


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = [r for r in rows if r["sweep"] == "size"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, style in (("constant", "-"), ("normal", "--")):
        pts = sorted((r["bytes"] / 2**20, r) for r in size if r["mode"] == mode)
        if not pts:
            continue
        x = [p[0] for p in pts]
        ax.plot(x, [p[1]["kvfill GB/s"] for p in pts], "o" + style, color="C0", label=f"kvfill ({mode})")
        ax.plot(x, [p[1]["in-tree GB/s"] for p in pts], "s" + style, color="C1", label=f"in-tree ({mode})")
        ax.plot(x, [p[1]["memset GB/s"] for p in pts], style, color="k", alpha=0.6, label=f"memset ({mode} run)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes filled per step (MiB)")
    ax.set_ylabel("GB/s written")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw")
    p.add_argument("--out", default=None, help="path prefix for .json and .png (default: next to RAW)")
    a = p.parse_args(argv)
    with open(a.raw) as f:
        raw = json.load(f)
    rows = summarize(raw)
    out = a.out or os.path.splitext(a.raw)[0].replace("-raw", "")
    device = rows and raw["benchmarks"][0]["extra_info"].get("device", "cpu")
    info = C.machine_info(device or "cpu")
    info["cpu_brand"] = raw.get("machine_info", {}).get("cpu", {}).get("brand_raw")
    payload = {"machine": info, "command": "make bench  (pytest bench/test_bench_fill.py; bench/report.py)",
               "rows": rows}
    C.write_json(out + ".json", payload)
    title = f"kvfill vs in-tree vs memset - {info.get('gpu') or info['cpu_brand'] or info['cpu']}"
    try:
        plot(rows, out + ".png", title)
        print(f"wrote {out}.json and {out}.png")
    except ImportError:
        print(f"wrote {out}.json (matplotlib missing: no plot)")
    print(C.table(rows, COLUMNS))
    return rows


if __name__ == "__main__":
    main()
