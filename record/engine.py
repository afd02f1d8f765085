"""The vLLM engine's life cycle (``kvfill.record``, and the bench scripts).

``llm_engine``: vLLM's ``LLM``, shut down as vLLM's own entry points do
(``shutdown``: its executor stops and reaps its workers) whatever happens, so
no worker writes into the recording's work folder afterwards; a start that
fails after the workers came up stops them too.  The files vLLM's CPU backend
leaves (its FileStore rendezvous in the temp folder, its shared-memory
all-reduce segments in /dev/shm) go with the run's private temp folder
(``remove_vllm_tempdir``).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import glob
import os
import shutil
import tempfile
import weakref

SHM = "/dev/shm"


def multiprocessing_error() -> str | None:
    """Why kvfill-record cannot run with the environment's
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` (None: unset or 0, what it sets)."""
    value = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if value is None or value.strip().lower() in ("0", "false", ""):
        return None
    return (f"VLLM_ENABLE_V1_MULTIPROCESSING={value!r}: kvfill-record runs vLLM's engine in its own process - it "
            f"fetches each worker's recorded part by collective_rpc of a function, which vLLM's multiprocess "
            f"client does not send - so unset it (kvfill-record sets 0) or set it to 0")


def env_defaults(**values: str):
    """A decorator: the function runs with ``values`` in ``os.environ``
    where they are unset, taken out again when it returns, so a caller in
    the same process (kvfill-check --in-process, a test) keeps its own
    environment - a default left behind would read later as the user's."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            added = {k: v for k, v in values.items() if k not in os.environ}
            os.environ.update(added)
            try:
                return fn(*args, **kwargs)
            finally:
                for k in added:
                    os.environ.pop(k, None)
        return run
    return wrap


@contextlib.contextmanager
def _private_tempdir():
    """vLLM's rendezvous file (``vllm_dist_<id>``, made by the engine's
    process in ``tempfile.gettempdir()``) and the ZMQ sockets of the
    processes it spawns (``TMPDIR``: a two-node recording's left zero-byte
    socket files in the user's temp folder) go into a folder of the run's
    own; its name is the prefix of the shared-memory segments vLLM CPU's
    workers make.  Yields a function returning the ids seen so far; the
    folder and every segment of those ids are removed at the end."""
    folder = tempfile.mkdtemp(prefix="kvfill-record-vllm-")
    before, ids = tempfile.tempdir, set()

    def seen() -> set[str]:
        ids.update(os.path.basename(p) for p in glob.glob(os.path.join(folder, "vllm_dist_*")))
        return ids

    tempfile.tempdir = folder
    env_before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder  # the processes vLLM spawns too: their ZMQ sockets (VLLM_RPC_BASE_PATH) land here
    try:
        yield seen
    finally:
        tempfile.tempdir = before
        if env_before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = env_before
        remove_vllm_tempdir(folder, seen())


def remove_vllm_tempdir(folder: str, idents=()) -> None:
    """A stopped vLLM run's temp folder (``TMPDIR`` of a server kvfill
    started, or ``_private_tempdir``), with the shared-memory segments of
    the rendezvous ids it held or ``idents`` names."""
    idents = set(idents) | {os.path.basename(p) for p in glob.glob(os.path.join(folder, "vllm_dist_*"))}
    for ident in idents:
        for path in glob.glob(os.path.join(SHM, glob.escape(ident) + "-*")):
            with contextlib.suppress(OSError):
                os.unlink(path)
    shutil.rmtree(folder, ignore_errors=True)


def _executors() -> list:
    from vllm.v1.executor.abstract import Executor

    found = []
    for o in gc.get_objects():
        try:
            if isinstance(o, Executor):
                found.append(o)
        except ReferenceError:  # a weak proxy whose object is gone (isinstance asks it for its class)
            continue
    return found


def _stop_executors_since(before) -> None:
    """A start that failed after vLLM's workers came up (a refusal in the
    engine core's init, e.g. the bank check) leaves its executor alive until
    this process exits (its finalizer holds it): stop the executors made
    since ``before`` (a WeakSet) now, so their workers go with the failure."""
    for executor in _executors():
        if executor not in before:
            with contextlib.suppress(Exception):
                executor.shutdown()


def shutdown(llm) -> None:
    """Stop vLLM's engine as its entry points do: the engine core's
    shutdown stops the executor, which reaps its workers (killing those that
    do not exit), and tears down the distributed state."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()


@contextlib.contextmanager
def llm_engine(**kwargs):
    """vLLM's ``LLM(**kwargs)``, stopped on leaving (``shutdown``: its workers
    reaped) with the files vLLM CPU's workers leave removed: what kvfill
    starts, it cleans up.  The recorder and the bench scripts run engines so."""
    from vllm import LLM

    before = weakref.WeakSet(_executors())
    with _private_tempdir() as seen:
        try:
            llm = LLM(**kwargs)
        except BaseException:
            _stop_executors_since(before)
            raise
        try:
            seen()  # the rendezvous file exists while the workers run
            yield llm
        finally:
            shutdown(llm)
