"""A recording over several nodes fails on every node within seconds when a
node stops or never starts (``record/liveness.py``), against a real
torch.distributed store standing in for the first node's rendezvous: a
further node gives up on a first node that never comes up or goes away, the
first node on a further node that never joins, stops beating or says it left;
each stops the workers it started and names the node; the first node's main
thread is interrupted when vLLM's wait does not fail on its own.  The same
on vLLM's engines, measured: ``tests/test_record.py``'s two-node test and
``bench/node_failures.py``."""
import multiprocessing
import re
import socket
import threading
import time

import pytest
from torch.distributed import TCPStore

from kvfill.record import liveness
from kvfill.record.liveness import NodeLost, NodeWatch, watching


@pytest.fixture
def fast(monkeypatch):
    """The watch's periods cut to fractions of a second."""
    monkeypatch.setattr(liveness, "BEAT_S", 0.1)
    monkeypatch.setattr(liveness, "NODE_SILENCE_S", 0.6)
    monkeypatch.setattr(liveness, "GRACE_S", 0.2)
    monkeypatch.setattr(liveness, "INTERRUPT_AFTER_S", 0.3)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_node_store():
    """The first node's rendezvous: a store served on a loopback port."""
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def until(predicate, limit: float) -> float:
    """Seconds until ``predicate()`` holds; fails past ``limit``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < limit, f"not within {limit} s"
        time.sleep(0.02)
    return time.monotonic() - start


def worker():
    """A stand-in for one of this node's vLLM workers: blocked forever."""
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=True)
    child.start()
    return child


def test_a_further_node_gives_up_on_a_first_node_that_never_comes_up_and_stops_its_workers(fast):
    watch = NodeWatch(("127.0.0.1", free_port()), 1, 2, wait_s=0.5, log=lambda m: None)
    child = worker()
    watch._ours.discard(child)  # started after the watch, as vLLM's workers are
    watch.start()
    took = until(lambda: watch.reason is not None, 5)
    assert 0.4 < took < 3, took
    assert watch.reason.startswith("node 1: the first node's engine at 127.0.0.1:") and \
        "did not come up within --node-wait 0.5 s" in watch.reason, watch.reason
    until(lambda: not child.is_alive(), 5)
    watch.stop()


def test_workers_the_node_had_before_the_watch_are_left_alone(fast):
    child = worker()
    watch = NodeWatch(("127.0.0.1", free_port()), 1, 2, wait_s=0.2, log=lambda m: None).start()
    until(lambda: watch.reason is not None, 5)
    watch.stop()
    assert child.is_alive()
    child.kill()
    child.join()


def test_the_first_node_names_a_further_node_that_never_joins(fast):
    store = first_node_store()
    first = NodeWatch(("127.0.0.1", store.port), 0, 3, wait_s=0.5, log=lambda m: None)
    second = NodeWatch(("127.0.0.1", store.port), 1, 3, wait_s=5, log=lambda m: None)
    second.start(), first.start()  # node 2 never starts
    took = until(lambda: first.reason is not None, 5)
    assert first.reason.startswith("node 2 of 3 did not join the recording within --node-wait 0.5 s"), first.reason
    assert 0.4 < took < 3 and second.reason is None
    first.stop(), second.stop()


def test_a_further_node_that_stops_beating_is_named_within_the_stall_bound(fast):
    """A node killed (SIGKILL, its machine gone) says nothing: its beat stalls."""
    store = first_node_store()
    first = NodeWatch(("127.0.0.1", store.port), 0, 2, wait_s=5, log=lambda m: None)
    second = NodeWatch(("127.0.0.1", store.port), 1, 2, wait_s=5, log=lambda m: None)
    second.start(), first.start()
    time.sleep(1.0)  # beating: nothing wrong
    assert first.reason is None and second.reason is None
    second.stop()  # no last word
    took = until(lambda: first.reason is not None, 5)
    assert 0.5 < took < 2.5, took
    assert first.reason.startswith("node 1 of 2 went away during the recording (no beat for"), first.reason
    assert "--node-silence 0.6 s" in first.reason and "paused" in first.reason
    first.stop()


def test_a_pause_shorter_than_node_silence_is_not_a_node_gone_and_a_longer_one_is_named_with_it(fast):
    """A node paused (SIGSTOP, a debugger, a live migration) beats again
    when it resumes: within ``--node-silence`` (here 2 s, over the 0.6 s the
    other tests use) the recording goes on; past it the node is named with
    the silence it was given."""
    store = first_node_store()
    first = NodeWatch(("127.0.0.1", store.port), 0, 2, wait_s=5, log=lambda m: None, silence_s=2.0)
    second = NodeWatch(("127.0.0.1", store.port), 1, 2, wait_s=5, log=lambda m: None)
    second.start(), first.start()
    time.sleep(0.5)
    second.stop()  # paused: no beat, no last word
    time.sleep(1.2)  # twice the default here, under the silence given
    resumed = NodeWatch(("127.0.0.1", store.port), 1, 2, wait_s=5, log=lambda m: None).start()  # beats again
    time.sleep(0.5)
    assert first.reason is None
    resumed.stop()
    took = until(lambda: first.reason is not None, 6)
    assert 1.8 < took < 4, took
    assert re.search(r"\(no beat for \d+ s, --node-silence 2 s: its process or machine stopped, is paused", first.reason), \
        first.reason
    first.stop()


def test_a_further_node_stopped_by_a_signal_says_so_and_the_first_node_names_it_at_once(fast):
    store = first_node_store()
    first = NodeWatch(("127.0.0.1", store.port), 0, 2, wait_s=5, log=lambda m: None)
    second = NodeWatch(("127.0.0.1", store.port), 1, 2, wait_s=5, log=lambda m: None)
    second.start(), first.start()
    time.sleep(0.5)
    second.stop(gone="stopped by signal 15")
    took = until(lambda: first.reason is not None, 5)
    assert took < 0.5, took  # not the stall bound
    assert first.reason == "node 1 of 2 left the recording (stopped by signal 15); nothing written, this node's " \
                           "workers stopped"
    first.stop()


def test_a_further_node_names_a_first_node_gone_before_it_ended_the_recording(fast):
    store = first_node_store()
    second = NodeWatch(("127.0.0.1", store.port), 1, 2, wait_s=5, log=lambda m: None).start()
    until(lambda: second.store is not None, 5)
    time.sleep(0.3)
    del store  # the first node's engine stopped: its rank 0 served the store
    until(lambda: second.reason is not None, 10)
    assert second.reason.startswith("node 1: the first node's engine at 127.0.0.1:") and \
        "stopped before it ended the recording" in second.reason, second.reason
    second.stop()


def test_a_first_node_that_ended_the_recording_is_not_a_node_gone(fast):
    store = first_node_store()
    ended = threading.Event()
    second = NodeWatch(("127.0.0.1", store.port), 1, 2, wait_s=5, log=lambda m: None, ended=ended).start()
    until(lambda: second.store is not None, 5)
    ended.set()  # the first node's end message, then its engine stops
    del store
    time.sleep(1.0)
    assert second.reason is None
    second.stop()


def test_the_first_nodes_main_thread_is_interrupted_when_vllms_wait_does_not_fail(fast):
    """vLLM waiting on a queue that never fails (no worker of this node to
    kill): the watch raises NodeLost in the main thread, naming the node."""
    store = first_node_store()
    kwargs = {"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": store.port}
    start = time.monotonic()
    with pytest.raises(NodeLost, match=r"^node 1 of 2 did not join the recording within --node-wait 0.3 s"):
        with watching(kwargs, 0.3, log=lambda m: None):
            while time.monotonic() - start < 10:  # vLLM's wait
                time.sleep(0.05)
    assert time.monotonic() - start < 3


def test_an_error_of_vllms_after_a_node_went_away_is_reported_as_that_node_gone(fast):
    kwargs = {"nnodes": 2, "node_rank": 1, "master_addr": "127.0.0.1", "master_port": free_port()}
    with pytest.raises(NodeLost, match=r"did not come up within --node-wait 0.2 s") as info:
        with watching(kwargs, 0.2, log=lambda m: None) as watch:
            until(lambda: watch.reason is not None, 5)
            raise RuntimeError("WorkerProc initialization failed")  # what vLLM says once the workers are killed
    assert isinstance(info.value.__cause__, RuntimeError)


def test_one_node_is_not_watched():
    with watching({"tensor_parallel_size": 2}, 60) as watch:
        assert watch is None


def test_the_interrupt_is_sent_again_while_it_lands_where_vllm_handles_an_error_of_its_own(fast):
    """An interrupt that arrives inside an ``except`` clause (vLLM's own
    error handling) is let be; the watch sends it again until it lands."""
    store = first_node_store()
    kwargs = {"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": store.port}
    start = time.monotonic()
    with pytest.raises(NodeLost):
        with watching(kwargs, 0.2, log=lambda m: None):
            while time.monotonic() - start < 20:
                try:
                    raise TimeoutError
                except TimeoutError:
                    time.sleep(0.1)  # half the time inside an except clause
                time.sleep(0.1)
    assert time.monotonic() - start < 15


def test_a_sigusr2_from_someone_else_reaches_their_handler_not_the_watchs(fast):
    import os
    import signal

    store = first_node_store()
    kwargs = {"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": store.port}
    got = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: got.append(signum))
    try:
        with watching(kwargs, 30, log=lambda m: None) as watch:
            os.kill(os.getpid(), signal.SIGUSR2)  # a job scheduler's warning, say
            time.sleep(0.2)
            assert watch.reason is None
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert got == [signal.SIGUSR2]


def test_a_signal_stays_a_signal_when_a_node_is_gone_meanwhile(fast):
    """Ctrl-C is the user's: it exits as an interruption, not as the node gone."""
    kwargs = {"nnodes": 2, "node_rank": 1, "master_addr": "127.0.0.1", "master_port": free_port()}
    with pytest.raises(KeyboardInterrupt):
        with watching(kwargs, 0.2, log=lambda m: None) as watch:
            until(lambda: watch.reason is not None, 5)
            raise KeyboardInterrupt
