"""A process we did not start ourselves (vLLM's engine core) dies with us: ``reap_with_us``'s
reaper kills it, and what runs under it, when its owner is SIGKILLed; a pid that now names
another process is left alone."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from world_runs import alive, alive_after

OWNER = textwrap.dedent("""
    import subprocess, sys, time
    from megatron_rl.lifetime import reap_with_us
    # An "engine core" in a session of its own (as vLLM's is out of our reach), with a child.
    core = subprocess.Popen([sys.executable, "-c",
                             "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"],
                            start_new_session=True)
    time.sleep(1.0)
    reap_with_us([core.pid])
    print(core.pid, flush=True)
    time.sleep(300)
""")


def _children(pid: int):
    import psutil

    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def test_killed_owner_takes_the_processes_it_did_not_start_with_it():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        core = int(owner.stdout.readline())
        tree = [core, *_children(core)]
        assert len(tree) == 2 and alive(tree)
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        assert not alive_after(tree, 10), "the engine core outlived its killed owner"
    finally:
        for pid in alive([owner.pid]):
            os.kill(pid, signal.SIGKILL)


def test_reaper_leaves_a_reused_pid_alone():
    from megatron_rl.reaper import _kill_trees

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _kill_trees([(bystander.pid, time.time() - 1000.0)])  # recorded start time of another process
        time.sleep(0.3)
        assert bystander.poll() is None
    finally:
        bystander.kill()


def test_a_process_forked_after_forks_die_with_us_dies_with_its_parent():
    """What megatron-core's checkpoint writer forks during a save: killed with the rank, not
    left orphaned in the rank's session."""
    script = textwrap.dedent("""
        import multiprocessing as mp, time
        from megatron_rl.lifetime import forks_die_with_us
        forks_die_with_us()
        child = mp.get_context("fork").Process(target=time.sleep, args=(120,))
        child.start()
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(owner.stdout.readline())
        assert alive([child])
    finally:
        owner.kill()
        owner.wait()
    assert not alive_after([child], 10), "the forked child outlived its killed parent"


def test_the_checkpoint_writer_comes_back_after_the_thread_that_started_it_ends():
    """The writer's Manager dies with the thread that started it (its parent-death signal follows
    that thread): a trainer's learner thread, in a process that goes on. The next save gets a
    new one instead of the dead one's queue."""
    import threading

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_rl import lifetime

    # A Manager of this process started by the main thread (an earlier test's save) would stay:
    # this test starts its own from a thread.
    if lifetime._writer_manager is not None:
        lifetime._writer_manager.shutdown()
    lifetime._writer_manager = lifetime._writer_queue = None
    starter = threading.Thread(target=lambda: (lifetime.checkpoint_writer_dies_with_us(), lifetime._results_queue()))
    starter.start()
    starter.join()
    first = lifetime._writer_manager
    deadline = time.time() + 20
    while first._process.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    assert not first._process.is_alive()
    queue = filesystem_async._get_write_results_queue()
    queue.put("written")
    assert queue.get(timeout=10) == "written" and lifetime._writer_manager is not first
