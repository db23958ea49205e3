"""perf/thread_cpu.py reads every thread's CPU time of a process tree from /proc."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "perf"))
import thread_cpu

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")


def test_a_busy_thread_and_a_child_process_are_counted():
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], name="spin")
    spinner.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        before = thread_cpu.cpu_by_thread({os.getpid()})
        stop.wait(0.3)
        after = thread_cpu.cpu_by_thread({os.getpid()})
        key = (os.getpid(), spinner.native_id)
        assert after[key][1] > before[key][1]  # the spinning thread used CPU in between
        assert child.pid in thread_cpu._children(os.getpid())
    finally:
        stop.set()
        spinner.join()
        child.kill()
        child.wait()


def test_threads_of_one_name_in_one_process_are_all_reported():
    """torch's worker threads share their process's OS name: the JSON keeps each of them."""
    rows = [(60.0, 7, "python", 11), (10.0, 7, "python", 12), (5.0, 7, "worker", 13), (5.0, 8, "python", 21),
            (0.1, 7, "idle", 14)]
    assert thread_cpu._by_thread(rows) == {"7:python#11": 60.0, "7:python#12": 10.0, "7:worker": 5.0,
                                           "8:python": 5.0}
