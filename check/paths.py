"""Checks of the paths kvfill-check reads and writes, before anything
runs: ``--out`` a folder the check can make or write, each input a
regular file that can be read (the recording and the runs each read it)."""
import os


def check_out(out: str) -> None:
    """``--out`` is a folder the check makes or writes into."""
    from .cli import CheckError

    if os.path.exists(out) and not os.path.isdir(out):
        raise CheckError(f"--out {out!r} exists and is not a folder; expected a folder for the report (made if "
                         f"missing)")
    parent = os.path.abspath(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise CheckError(f"--out {out!r}: {parent!r} is not a writable folder; expected --out in a folder the "
                         f"check can write")
    # Permission bits do not say it all (root passes them; /proc and read-only mounts refuse anyway): a folder
    # made and removed at once says whether the check's own will be.
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvfill-check-", dir=parent))
    except OSError as exc:
        raise CheckError(f"--out {out!r}: no folder can be made in {parent!r} ({exc.strerror}); expected --out "
                         f"in a folder the check can write") from None


def check_file(flag: str, path: str, expected: str) -> None:
    """An input file the check reads (perhaps more than once: the recording and the runs each read the
    prompts): a regular file that exists."""
    from .cli import CheckError

    if os.path.isdir(path):
        raise CheckError(f"{flag} {path!r} is a folder; expected {expected}")
    if not os.path.exists(path):
        raise CheckError(f"{flag} {path!r}: no such file; expected {expected}")
    if not os.path.isfile(path):
        raise CheckError(f"{flag} {path!r} is not a regular file (a pipe or device is read once, the check reads "
                         f"it more than once); expected {expected}")
    if not os.access(path, os.R_OK):
        raise CheckError(f"{flag} {path!r}: not readable here; expected {expected}")
