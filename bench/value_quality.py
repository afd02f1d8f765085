"""Measure the synthetic-KV generator: mean, std, neighbour correlations.

    python bench/value_quality.py [--tokens 65536] [--row 1024]

Fills one layer of ``tokens`` token rows of ``row`` fp32 elements (mean 0,
std 1) and a second layer, then reports the sample mean and std and the
Pearson correlation between neighbouring elements of a row, neighbouring
tokens, the same token in two layers, and tokens that are 4096 apart.
"""
from __future__ import annotations

import argparse

import torch

from kvfill.kernels import fill_blocks


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--row", type=int, default=1024)
    a = p.parse_args(argv)
    bs = 16
    layer0 = torch.zeros(a.tokens // bs, 1, bs, a.row)
    layer1 = torch.zeros_like(layer0)
    fill_blocks([layer0, layer1], list(range(a.tokens // bs)), mean=0.0, std=1.0, seed=0)
    x = layer0.reshape(a.tokens, a.row)  # [token, element]
    y = layer1.reshape(a.tokens, a.row)
    n = x.numel()
    figures = {
        "samples": n,
        "mean": float(x.double().mean()),
        "std": float(x.double().std()),
        "sampling error of the mean (1/sqrt(n))": n**-0.5,
        "corr(element e, e+1)": corr(x[:, 1:], x[:, :-1]),
        "corr(token t, t+1)": corr(x[1:], x[:-1]),
        "corr(token t, t+4096)": corr(x[4096:], x[:-4096]) if a.tokens > 4096 else float("nan"),
        "corr(layer 0, layer 1)": corr(x, y),
    }
    for k, v in figures.items():
        print(f"{k:>40}: {v:.5f}" if isinstance(v, float) else f"{k:>40}: {v}")
    return figures


if __name__ == "__main__":
    main()
