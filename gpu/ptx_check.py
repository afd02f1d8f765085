"""Compile the fill kernel for a GPU on a machine without one and read its PTX.

    python gpu/ptx_check.py [--arch 90]

Triton's NVIDIA backend (with its bundled ptxas) compiles without a driver, so
this shows, for representative cache geometries, whether the kernel's global
stores and table (or replayed bank) loads are vectorised (``st.global.v4`` = 16 bytes per thread)
or scalar.  A scalar store of 1-2 bytes per thread would keep a fill far from
memset bandwidth; this is the check available until a GPU run measures it.
Must run without TRITON_INTERPRET=1.
"""
from __future__ import annotations

import argparse
import os
import re

import torch

from kvfill.bench import common as C  # noqa: E402


def compile_ptx(layout, mode: str, arch: int = 90) -> str:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("ptx_check compiles real GPU code: unset TRITON_INTERPRET")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvfill.kernels import triton_backend as tb
    from kvfill.kernels import triton_fill as tf

    bits = {1: "u8", 2: "i16", 4: "i32", 8: "i64"}[layout.itemsize]
    sig = {
        "entries_ptr": "*i32", "layers_ptr": "*i64", "ref_ptr": f"*{bits}", "table_ptr": f"*{bits}",
        "dcp_world_size": "i32", "dcp_rank": "i32", "dcp_interleave": "i32", "num_blocks": "i32",
        "seqs_ptr": "*i64", "bank_sequences": "i32",
    }
    align = 16 // layout.itemsize
    if mode == "replay":  # a bank whose rows are the layer's rows, 16-byte aligned, sequences per entry
        consts = tf.kernel_constexprs(layout, mode, align, entry_cols=5, bank_row=layout.row_size,
                                      bank_align=tb.pow2_dividing([layout.row_size], align))
    else:
        consts = tf.kernel_constexprs(layout, mode, layer_align=align)
    names = list(sig) + list(consts)
    sig.update({k: "constexpr" for k in consts})
    # Pointer arguments are 16-byte aligned (Triton specialises on that at launch).
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, names.index("seqs_ptr"))}
    src = ASTSource(tf.scatter_fill_kernel, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32)).asm["ptx"]


def memory_ops(ptx: str) -> dict[str, int]:
    """Counts of global stores/loads by width: e.g. {'st.v4': 4, 'ld.b16': 0}."""
    out: dict[str, int] = {}
    for op, width in re.findall(r"\b(st|ld)\.global(?:\.[a-z_]+)*?\.(v4|v2|b8|b16|b32|b64)\b", ptx):
        out[f"{op}.{width}"] = out.get(f"{op}.{width}", 0) + 1
    return out


MODES = ("constant", "normal", "replay")
CASES = [
    # (name, dtype, layout, heads, content)
    ("LBNHC bf16 H8 C256", torch.bfloat16, "LBNHC", 8, 256),
    ("BHLNC bf16 H8 C256", torch.bfloat16, "BHLNC", 8, 256),
    ("LBNHC fp8 H8 C256", torch.uint8, "LBNHC", 8, 256),
    ("LBNHC fp32 H4 C128", torch.float32, "LBNHC", 4, 128),
    ("MLA bf16 C576", torch.bfloat16, "LBNHC", 1, 576),
]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arch", type=int, default=90)
    a = p.parse_args(argv)
    from kvfill.kernels import layout_of

    rows = []
    for name, dtype, order, heads, content in CASES:
        _, views = C.standard_views(2, 64, heads, 16, content, dtype, order)
        lay = layout_of(views[0])
        for mode in MODES:
            ops = memory_ops(compile_ptx(lay, mode, a.arch))
            rows.append({"case": name, "mode": mode, **{k: ops[k] for k in sorted(ops)}})
    cols = ["case", "mode"] + sorted({k for r in rows for k in r} - {"case", "mode"})
    print(f"global memory instructions in the sm_{a.arch} PTX (per kernel body, not per element)")
    print(C.table(rows, cols))
    return rows


if __name__ == "__main__":
    main()


def compile_zoo(arch: int = 90) -> list[dict]:
    """Compile the kernel for every cache layout of kvfill.kernels.testing (bf16 and
    fp8-in-uint8, constant, normal and replay): the constexpr combinations the GPU
    will see, checked to compile without a GPU."""
    from kvfill.kernels import testing as LZ

    from kvfill.kernels import layout_of

    rows = []
    for case in LZ.CASES:
        for dtype in (torch.bfloat16, torch.uint8):
            itemsize = torch.empty((), dtype=dtype).element_size()
            made = case.make(torch.zeros(case.nbytes(itemsize), dtype=torch.uint8), dtype)
            first = next(iter(made.values()))
            tensors = first if isinstance(first, list) else [first]
            for t in tensors:
                lay = layout_of(t, block_dim=case.block_dim, slot_dim=case.slot_dim,
                                num_blocks=LZ.NUM_BLOCKS if case.slot_dim is not None else None)
                for mode in MODES:
                    ops = memory_ops(compile_ptx(lay, mode, arch))
                    rows.append({"case": case.name, "dtype": str(dtype).split(".")[-1], "mode": mode, **ops})
    return rows
