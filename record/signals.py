"""What stops a recording (``kvfill.record``): SIGTERM and SIGINT.

``stop_signals``: SIGTERM and SIGINT (``kill``, a job scheduler, Ctrl-C,
which a terminal sends to vLLM's workers too) stop the recording as an
exception in the main thread, and whatever error vLLM turns the signal into
(its workers die first: ``RuntimeError: cancelled``) is reported as the
signal: KeyboardInterrupt (exit 130) or SystemExit(128 + signum).
"""
from __future__ import annotations

import contextlib
import signal
import threading
from types import SimpleNamespace


@contextlib.contextmanager
def stop_signals():
    """SIGTERM and SIGINT raise in the main thread while the recorder runs
    (module docstring); a second one is ignored, so it does not cut the
    cleanup short.  Only the main thread can handle signals, and a handler
    the caller installed is left alone.  Yields the state: ``signum``."""
    state = SimpleNamespace(signum=None)
    defaults = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    installed = {s: signal.getsignal(s) for s, d in defaults.items() if signal.getsignal(s) is d}

    def stop(signum, frame):
        for s in installed:
            signal.signal(s, signal.SIG_IGN)
        if state.signum is None:
            state.signum = signum
            raise _exception(signum)

    for s in installed:
        signal.signal(s, stop)
    try:
        yield state
    except BaseException as exc:
        if state.signum is None or (isinstance(exc, (KeyboardInterrupt, SystemExit))
                                    and type(exc) is type(_exception(state.signum))):
            raise
        raise _exception(state.signum) from exc  # vLLM's error for it: the signal is what happened
    finally:
        for s, handler in installed.items():
            signal.signal(s, handler)


def _exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)
