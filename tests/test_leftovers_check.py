"""The suite's leftovers check (``conftest.nothing_left``, the
``leaves_nothing`` fixture) counts only what the test's own processes made,
so the suite runs beside other vLLM work on the machine (issue 38: another
recording's files failed two tests), and still catches a leak of the test's
own: a rendezvous file, a worker's parts folder, or a shared-memory segment
that outlives the rendezvous that named it."""
import os
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from conftest import nothing_left

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm")


def test_what_other_processes_make_meanwhile_is_not_the_tests(tmp_path):
    """Another process on the machine (its own temp folder: the one the test
    had before) makes a recording's work folder and a vLLM rendezvous with
    its shared-memory segment while the test runs."""
    other_tmp = tempfile.gettempdir()
    ident = f"vllm_dist_{uuid.uuid4().hex}"
    made = [os.path.join(other_tmp, "kvfill-record-other-run"), os.path.join(other_tmp, ident),
            os.path.join(SHM, f"{ident}-[0-1]-cpushm")]
    script = "import os, sys\nos.mkdir(sys.argv[1])\nfor p in sys.argv[2:]: open(p, 'w').close()\n"
    try:
        with nothing_left(tmp_path):
            assert tempfile.gettempdir() != other_tmp and os.environ["TMPDIR"] == tempfile.gettempdir()
            subprocess.run([sys.executable, "-c", script, *made], check=True, env={**os.environ, "TMPDIR": other_tmp})
            time.sleep(0.3)  # the watch of rendezvous ids polls meanwhile
        assert all(os.path.exists(p) for p in made)
    finally:
        os.rmdir(made[0])
        for p in made[1:]:
            if os.path.exists(p):
                os.unlink(p)
    assert tempfile.gettempdir() == other_tmp


def test_a_segment_of_the_tests_own_rendezvous_left_behind_is_named(tmp_path):
    ident = f"vllm_dist_{uuid.uuid4().hex}"
    segment = os.path.join(SHM, f"{ident}-[0-1]-cpushm")
    try:
        with pytest.raises(AssertionError, match=r"left behind: .*" + ident):
            with nothing_left(tmp_path):
                rendezvous = os.path.join(tempfile.gettempdir(), "kvfill-record-vllm-x", ident)
                os.makedirs(os.path.dirname(rendezvous))
                open(rendezvous, "w").close()  # a worker's rendezvous file, in the test's temp folder
                open(segment, "w").close()     # and its all-reduce's segment
                time.sleep(0.3)
                os.unlink(rendezvous)          # the run's folder is removed, the segment is not
                os.rmdir(os.path.dirname(rendezvous))
    finally:
        if os.path.exists(segment):
            os.unlink(segment)


def test_a_workers_parts_folder_left_in_the_tests_temp_folder_is_named(tmp_path):
    with pytest.raises(AssertionError, match=r"left behind: \[.*kvfill-parts-run-tp0"):
        with nothing_left(tmp_path):
            os.mkdir(os.path.join(tempfile.gettempdir(), "kvfill-parts-run-tp0"))
