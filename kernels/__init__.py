"""kvfill.kernels: fill paged KV caches with synthetic KV (no vLLM import here).

Public API:
    fill_blocks / verify_blocks     functional fill of whole blocks (custom op)
    FillEngine, CacheGroup          register caches once, fill plans per step
    FillPlan, GroupFill             the plan format (a list of entries per group)
    DcpGeometry                     which rank holds which token of a group (kvfill.bank, re-exported here)
    ValueSpec                       what is written (mean, std, seed)
    Bank, BankIndex                 recorded KV rows a replay fill writes (kvfill.bank, re-exported here)
    layout_of, Layout               how a tensor is addressed
    kvfill.kernels.testing          the layout zoo and helpers for tests and checks
"""
if __name__ != "kvfill.kernels":
    # This folder imported by path as a top-level `kernels` (the repo root on
    # sys.path, and transformers probing for the Hugging Face `kernels`
    # package).  Stay empty: a second copy of the modules would register the
    # torch custom op again and split the engine cache between two copies.
    __all__: list[str] = []
else:
    from kvfill.bank import NO_DCP, Bank, BankError, BankIndex, DcpGeometry  # re-exported: kvfill/bank/

    from .api import (
        captured_engines,
        clear_engine_cache,
        fill_blocks,
        num_cached_engines,
        release_captured_fills,
        verify_blocks,
    )
    from .engine import FillEngine, FillStats
    from .layout import Layout, layout_of
    from .plan import FillPlan, GroupFill
    from .registry import CacheGroup, RegisteredGroup, RowParts
    from .values import POOL_SIZE, ValueSpec
    from .verify import Mismatch, VerifyReport

    __all__ = [
        "Bank",
        "BankError",
        "BankIndex",
        "CacheGroup",
        "DcpGeometry",
        "FillEngine",
        "FillPlan",
        "FillStats",
        "GroupFill",
        "Layout",
        "Mismatch",
        "NO_DCP",
        "POOL_SIZE",
        "RegisteredGroup",
        "RowParts",
        "ValueSpec",
        "VerifyReport",
        "captured_engines",
        "clear_engine_cache",
        "fill_blocks",
        "layout_of",
        "num_cached_engines",
        "release_captured_fills",
        "verify_blocks",
    ]
