"""The workers' recorded parts fetched to the recorder (``kvfill.record``):
through vLLM's own RPC channel to its workers, in chunks, so no filesystem
need be shared by the nodes (the worker side: ``connector/recorder.py``).
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile


CHUNK_BYTES = 32 << 20  # the most of a part one RPC message carries


def fetch_parts(llm, work: str) -> int:
    """Every worker's parts into ``work`` through vLLM's own channel to its
    workers (``collective_rpc``: every executor backend, any number of
    nodes), in chunks of at most ``CHUNK_BYTES``; then the workers drop
    theirs.  Returns the bytes fetched."""
    from kvfill.connector.recorder import rpc_drop_parts, rpc_list_parts, rpc_read_part

    total = 0
    for part_id, files in llm.collective_rpc(rpc_list_parts):
        for name, size in files:
            dst = os.path.join(work, os.path.basename(name))
            with open(dst + ".part", "wb") as f:
                for offset in range(0, size, CHUNK_BYTES):
                    want = min(CHUNK_BYTES, size - offset)
                    got = [c for c in llm.collective_rpc(rpc_read_part, args=(part_id, name, offset, want))
                           if c is not None]
                    if len(got) != 1 or len(got[0]) != want:
                        raise RuntimeError(f"part {name} of worker {part_id}: {want} bytes at {offset} arrived as "
                                           f"{[len(c) for c in got]} (the worker's file changed or went)")
                    f.write(got[0])
            os.replace(dst + ".part", dst)
            total += size
    llm.collective_rpc(rpc_drop_parts)
    return total


def drop_parts(record_dir: str) -> None:
    """The parts folders this node's workers left in its temp folder
    (``kvfill-parts-<record_dir's name>-*``): workers killed (the watch of the
    other nodes stops them so) cannot drop their own."""
    name = os.path.basename(os.path.normpath(record_dir))
    for folder in glob.glob(os.path.join(tempfile.gettempdir(), f"kvfill-parts-{glob.escape(name)}-*")):
        shutil.rmtree(folder, ignore_errors=True)
