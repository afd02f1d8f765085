"""Whether the other nodes of a recording over several nodes are still there
(``kvfill.record`` with ``--nnodes`` > 1): without it, a node whose peer went
away waits on vLLM's queues or torch's rendezvous for 30 minutes or forever.

Every node's kvfill-record runs a ``NodeWatch`` thread beside vLLM, over the
recording's own rendezvous (torch.distributed's store at ``--master-addr``:
``--master-port``, served by the first node's rank 0 while its engine runs):

- a further node waits ``--node-wait`` seconds for the first node's store,
  then adds to its beat key every ``BEAT_S``; the store going away before the
  first node ended the recording is the first node gone;
- the first node waits ``--node-wait`` seconds (from its store's start) for
  each further node's first beat, and takes a beat that stalls ``silence_s``
  (``--node-silence``, default ``NODE_SILENCE_S``)
  (a process killed, a machine gone) or a further node's own last word (its
  gone key: it was stopped) as that node gone.

A node gone stops this node's own vLLM workers (those started since the
watch began: they are blocked in a collective or a queue with the gone peer),
which makes vLLM's wait in the main thread fail; if it has not within
``INTERRUPT_AFTER_S``, the first node's main thread is interrupted
(``NodeLost`` raised there).  ``reason`` is then the one line naming the node.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from datetime import timedelta

from .inputs import RecordError

BEAT_S = 1.0            # a further node adds to its beat key this often
NODE_SILENCE_S = 10.0   # default --node-silence: a further node whose beat stalls this long is gone
NODE_WAIT_S = 120.0     # --node-wait's default: how long a node waits for its peers to come up
INTERRUPT_AFTER_S = 5.0  # the first node's main thread is interrupted if vLLM has not failed by then
GRACE_S = 3.0           # a further node's wait for the first node's end message once its store is gone


class NodeLost(RecordError):
    """A peer node went away (``NodeWatch.reason``)."""


def beat_key(node: int) -> str:
    return f"kvfill/record/beat/{node}"


def gone_key(node: int) -> str:
    return f"kvfill/record/gone/{node}"


def listening(host: str, port: int) -> bool:
    """Whether ``host:port`` accepts connections (the first node's store)."""
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        return False
    return True


def store_client(host: str, port: int):
    """A client of the recording's store that vLLM's rendezvous does not
    count (``wait_for_workers`` off) and that gives up within seconds."""
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))


class NodeWatch:
    """The watch of one node (module docstring).  ``head``: the first
    node's (master address, port); ``node``: this node's rank; ``ended``:
    an event a further node sets when the first node ended the recording."""

    def __init__(self, head: tuple[str, int], node: int, nnodes: int, wait_s: float, log=print,
                 ended: threading.Event | None = None, silence_s: float | None = None):
        self.head, self.node, self.nnodes, self.wait_s, self.log = head, node, nnodes, float(wait_s), log
        self.silence_s = float(NODE_SILENCE_S if silence_s is None else silence_s)
        self.ended = ended or threading.Event()
        self.reason: str | None = None
        self.store = None
        self._done = threading.Event()
        self._left = threading.Event()  # the main thread left the watched block
        self._ours = set(multiprocessing.active_children())
        self.interruptible = False  # the first node's main thread has the SIGUSR2 handler (``watching``)
        self._thread = threading.Thread(target=self._run, name=f"kvfill-node{node}-watch", daemon=True)

    def start(self) -> "NodeWatch":
        self._thread.start()
        return self

    def stop(self, gone: str | None = None) -> None:
        """Stop watching; a further node leaving for ``gone`` (not the
        first node's end) says so in its gone key, so the first node names
        it at once instead of after ``silence_s``."""
        self._done.set()
        self._left.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        if gone and self.node > 0 and self.store is not None and self.reason is None:
            with contextlib.suppress(Exception):
                self.store.set(gone_key(self.node), gone[:300])

    # the thread

    def _run(self) -> None:
        try:
            if self.node > 0:
                self._beat()
            else:
                self._watch_further_nodes()
        except Exception as exc:  # the watch must never take the recording down with an error of its own
            self.log(f"node {self.node}: the watch of the other nodes stopped ({type(exc).__name__}: {exc})")

    def _where(self) -> str:
        return f"{self.head[0]}:{self.head[1]}"

    def _wait_for_store(self, deadline: float | None) -> bool:
        while not self._done.is_set():
            if listening(*self.head):
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            self._done.wait(0.5)
        return False

    def _beat(self) -> None:
        if not self._wait_for_store(time.monotonic() + self.wait_s):
            if not self._done.is_set():
                self._lost(f"node {self.node}: the first node's engine at {self._where()} did not come up within "
                           f"--node-wait {self.wait_s:g} s (not started, or it failed at its own input checks: "
                           f"its error says why); this node's workers stopped")
            return
        key, failing = beat_key(self.node), None
        while not self._done.is_set():
            try:
                if self.store is None:
                    self.store = store_client(*self.head)
                self.store.add(key, 1)
                failing = None
            except Exception:  # a slow store, or none: the first node's engine stopped or ended the recording
                self.store, failing = None, failing or time.monotonic()
                closed = not listening(*self.head)
                gone = closed or time.monotonic() - failing > self.silence_s
                if gone and not self._done.is_set() and not self.ended.wait(GRACE_S):
                    if closed:
                        return self._lost(f"node {self.node}: the first node's engine at {self._where()} stopped "
                                          f"before it ended the recording (its own error says why); this node's "
                                          f"workers stopped")
                    return self._lost(f"node {self.node}: no answer from the first node's store at {self._where()} "
                                      f"for {time.monotonic() - failing:.0f} s (--node-silence {self.silence_s:g} s: "
                                      f"it stopped, is paused or cannot be reached); this node's workers stopped")
                if gone:
                    return
            self._done.wait(BEAT_S)

    def _watch_further_nodes(self) -> None:
        if not self._wait_for_store(None):
            return
        up = time.monotonic()
        self.store = store_client(*self.head)
        seen: dict[int, tuple[int, float]] = {}  # node: (beat count, when it last changed)
        while not self._done.wait(BEAT_S / 2):
            now = time.monotonic()
            for node in range(1, self.nnodes):
                try:
                    count = self.store.add(beat_key(node), 0)
                    last_word = self.store.get(gone_key(node)).decode() if self.store.check([gone_key(node)]) \
                        else None
                except Exception:  # a slow store: watched on; none: its own engine failed, and says why
                    if not listening(*self.head):
                        return
                    with contextlib.suppress(Exception):
                        self.store = store_client(*self.head)
                    break
                if last_word is not None:
                    return self._lost(f"node {node} of {self.nnodes} left the recording ({last_word}); "
                                      f"nothing written, this node's workers stopped")
                if count and seen.get(node, (0, 0.0))[0] != count:
                    seen[node] = (count, now)
                elif node not in seen and now - up > self.wait_s:
                    return self._lost(f"node {node} of {self.nnodes} did not join the recording within --node-wait "
                                      f"{self.wait_s:g} s of this node's engine start at {self._where()}; nothing "
                                      f"written, this node's workers stopped")
                elif node in seen and now - seen[node][1] > self.silence_s:
                    return self._lost(f"node {node} of {self.nnodes} went away during the recording (no beat for "
                                      f"{now - seen[node][1]:.0f} s, --node-silence {self.silence_s:g} s: its "
                                      f"process or machine stopped, is paused or cannot be reached); nothing "
                                      f"written, this node's workers stopped")

    def _lost(self, reason: str) -> None:
        """Stop this node's workers - again each half second while the block
        runs, for those vLLM starts meanwhile - and on the first node
        interrupt its main thread every ``INTERRUPT_AFTER_S`` until it leaves
        the block (one interrupt may land while vLLM handles an error of its
        own, where the handler lets it be)."""
        if self._done.is_set():
            return
        self.reason = reason
        self.log("kvfill-record: stopping this node's workers (the error that follows says why)")  # named once
        last = time.monotonic()
        while True:
            for proc in set(multiprocessing.active_children()) - self._ours:
                with contextlib.suppress(Exception):
                    proc.kill()
            if self._left.wait(0.5):
                return
            if self.interruptible and time.monotonic() - last >= INTERRUPT_AFTER_S:
                last = time.monotonic()
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)


@contextlib.contextmanager
def watching(llm_kwargs: dict, wait_s: float, log=print, ended: threading.Event | None = None,
             silence_s: float | None = None):
    """A ``NodeWatch`` of this node while the block runs (None on one
    node).  On the first node, in the main thread, SIGUSR2 raises
    ``NodeLost`` while the block runs (the watch's last resort); an error
    leaving the block once a node is gone becomes ``NodeLost`` naming it."""
    nnodes = int(llm_kwargs.get("nnodes") or 1)
    if nnodes <= 1:
        yield None
        return
    node = int(llm_kwargs.get("node_rank") or 0)
    head = (str(llm_kwargs.get("master_addr") or "127.0.0.1"), int(llm_kwargs.get("master_port") or 29501))
    watch = NodeWatch(head, node, nnodes, wait_s, log, ended, silence_s)
    main = threading.current_thread() is threading.main_thread()
    previous = None

    def interrupt(signum, frame):
        if watch.reason is None:  # not the watch's: whoever else sent it gets what they would have
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signal.SIGUSR2, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGUSR2)
            return
        if not watch._left.is_set() and sys.exc_info()[1] is None:  # not while vLLM's failure unwinds
            raise NodeLost(watch.reason)

    if main and node == 0:
        previous = signal.signal(signal.SIGUSR2, interrupt)
        watch.interruptible = True
    watch.start()
    try:
        yield watch
    except Exception as exc:  # a signal (KeyboardInterrupt, SystemExit) stays what it is
        watch.stop(gone=_why(exc))
        if watch.reason is not None and not isinstance(exc, NodeLost):
            raise NodeLost(watch.reason) from exc
        raise
    except BaseException as exc:
        watch.stop(gone=_why(exc))
        raise
    finally:
        watch.stop()
        if previous is not None:
            signal.signal(signal.SIGUSR2, previous)


def _why(exc: BaseException) -> str:
    """A further node's last word for the first node: why it leaves."""
    if isinstance(exc, SystemExit) and isinstance(exc.code, int) and exc.code > 128:
        return f"stopped by signal {exc.code - 128}"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return f"{type(exc).__name__}: {str(exc)[:200]}"
