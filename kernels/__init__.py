"""kvfill.kernels: fill paged KV caches with synthetic KV (no vLLM import here).

Public API:
    fill_blocks / verify_blocks     functional fill of whole blocks (custom op)
    FillEngine, CacheGroup          register caches once, fill plans per step
    FillPlan, GroupFill             the plan format (CSR entries per group)
    layout_of, Layout               how a tensor is addressed
"""
if __name__ != "kvfill.kernels":
    # This folder imported by path as a top-level `kernels` (the repo root on
    # sys.path, and transformers probing for the Hugging Face `kernels`
    # package).  Stay empty: a second copy of the modules would register the
    # torch custom op again and split the engine cache between two copies.
    __all__: list[str] = []
else:
    from .api import fill_blocks, verify_blocks
    from .engine import CacheGroup, FillEngine, FillStats, Mismatch, VerifyReport
    from .layout import Layout, layout_of
    from .plan import FillPlan, GroupFill
    from .values import POOL_SIZE

    __all__ = [
        "CacheGroup",
        "FillEngine",
        "FillPlan",
        "FillStats",
        "GroupFill",
        "Layout",
        "Mismatch",
        "POOL_SIZE",
        "VerifyReport",
        "fill_blocks",
        "layout_of",
        "verify_blocks",
    ]
