"""Tensors land on the caches' device, whatever torch's default device is.

A GPU run sets torch's default device to cuda (conftest), so it cannot see a
tensor made on the default device where the caches' device was meant; vLLM
itself leaves the default on the CPU.  These CPU tests make the two differ:
caches on the meta device, or torch's default device set to meta.
"""
import ast
import pathlib

import pytest
import torch

from kvfill.kernels import Bank, CacheGroup, FillEngine, GroupFill
from kvfill.kernels import torch_pages

# FlashAttention's (2, num_blocks, N, H, D) with 64 KiB pages (K of one block:
# 16 slots x 8 heads x 256 x bf16): the torch backend's whole-page paths.
B, N, H, D = 8, 16, 8, 256
ROOT = pathlib.Path(__file__).resolve().parents[1]


def fa_engine(cache, bank):
    return FillEngine({"g": CacheGroup({"l": cache}, block_dim=1)}, mean=0.0, std=1.0, backend="torch", bank=bank)


def fa_plan(replay):
    seq = {"sequence": [1, 1, 0]} if replay else {}
    return {"g": GroupFill(block_ids=[2, 3, 5], slot_end=[16, 16, 7], local_base=[0, 16, 32], **seq)}


def host_bank():
    """Ragged: sequence 1 (21 rows) wraps inside the second whole page."""
    g = torch.Generator(device="cpu").manual_seed(0)
    return Bank({"l": torch.randn(40 + 21, 2 * H * D, generator=g, device="cpu").to(torch.bfloat16)},
                sequence_lengths=[40, 21])


@pytest.mark.parametrize("replay", [False, True], ids=["normal", "replay"])
def test_torch_backend_fills_meta_caches_with_whole_pages(replay):
    torch_pages.page_gather.cache_clear()  # built on first use: this test must build it
    assert torch_pages.paged(fa_engine(torch.empty(2, 2, N, H, D, dtype=torch.bfloat16), None)
                             ._registry.classes[0]), "the case no longer takes the whole-page path"
    cache = torch.empty(2, B, N, H, D, dtype=torch.bfloat16, device="meta")
    bank = Bank({"l": torch.empty(40 + 21, 2 * H * D, dtype=torch.bfloat16, device="meta")},
                sequence_lengths=[40, 21]) if replay else None
    stats = fa_engine(cache, bank).fill(fa_plan(replay))
    assert stats.slots == 16 + 16 + 7


@pytest.mark.parametrize("replay", [False, True], ids=["normal", "replay"])
def test_torch_backend_writes_the_same_bytes_whatever_the_default_device(replay):
    def run(default):
        torch_pages.page_gather.cache_clear()
        g = torch.Generator(device="cpu").manual_seed(9)
        cache = torch.randint(0, 256, (2 * B * N * H * D * 2,), dtype=torch.uint8, generator=g, device="cpu")
        view = cache.view(torch.bfloat16).view(2, B, N, H, D)
        bank = host_bank() if replay else None
        before = torch.get_default_device()  # cuda in a GPU run (conftest)
        torch.set_default_device(default)
        try:
            eng = fa_engine(view, bank)
            eng.warmup(3 * N)
            eng.fill(fa_plan(replay))
        finally:
            torch.set_default_device(before)
        assert eng.verify(fa_plan(replay)).ok
        return cache

    assert torch.equal(run("meta"), run("cpu"))


RANDOM_FACTORIES = {"randn", "rand", "randint", "randperm", "normal", "rand_like", "randn_like", "randint_like"}


def _unpinned_random_calls(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """Calls that would meet another device than their generator under a GPU
    run: ``torch.Generator()`` without ``device=``, and a random factory given
    ``generator=`` without ``device=`` (made on torch's default device)."""
    bad = []
    calls = [n for n in ast.walk(ast.parse(path.read_text(), str(path)))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    for node in sorted(calls, key=lambda n: (n.lineno, n.col_offset)):
        kw = {k.arg for k in node.keywords}
        name = node.func.attr
        if name == "Generator" and "device" not in kw:
            bad.append(f"{path.relative_to(root)}:{node.lineno}: torch.Generator() without device=")
        elif name in RANDOM_FACTORIES and "generator" in kw and "device" not in kw and not name.endswith("_like"):
            bad.append(f"{path.relative_to(root)}:{node.lineno}: {name}(generator=...) without device=")
    return bad


def test_every_generator_and_seeded_draw_names_its_device():
    """A GPU run (conftest: default device cuda) refuses a CPU generator for a
    draw made on the default device; every seeded draw names its device."""
    files = sorted([*ROOT.joinpath("tests").glob("*.py"), *ROOT.joinpath("bench").glob("*.py"),
                    *ROOT.joinpath("bank").glob("*.py"), *ROOT.joinpath("kernels").glob("*.py"),
                    *ROOT.joinpath("connector").glob("*.py")])
    assert len(files) > 20
    bad = [b for f in files for b in _unpinned_random_calls(f)]
    assert not bad, "\n".join(bad)


def test_the_generator_check_finds_an_unpinned_draw(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("import torch\ng = torch.Generator().manual_seed(1)\nx = torch.randn(3, generator=g)\n"
                   "ok = torch.randn(3, generator=torch.Generator(device='cpu'), device='cpu')\n")
    found = _unpinned_random_calls(src, tmp_path)
    assert [f.split(": ")[1] for f in found] == ["torch.Generator() without device=",
                                                  "randn(generator=...) without device="]
