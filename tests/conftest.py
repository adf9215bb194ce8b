import os

# Keep each test process (and the ranks it launches) to one intra-op thread on the 2-core CI box.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# A test process holds torch, megatron-core and every test module: skip the seconds of garbage
# collection at its exit, as the entry points do (megatron_rl/lifetime.py).
from megatron_rl.lifetime import skip_final_gc  # noqa: E402

skip_final_gc()


@pytest.fixture(scope="session")
def megatron_world():
    """A one-process torch.distributed world with Megatron's parallel_state at TP=PP=1."""
    from megatron_rl.learner.parallel import init_model_parallel
    from megatron_rl.telemetry.run_dir import setup_logging

    setup_logging()
    init_model_parallel(1, 1, seed=0)
    yield


@pytest.fixture
def tiny_cfg():
    from megatron_rl.checks import load_config

    return load_config("tiny_cpu", ["trainer.progress=false"])


# The longest files first (about 650, 320, 220, 140 and 90 s on the 2-core CI box): tests/run.sh runs
# each file whole on one xdist worker (--dist loadfile), and a long file handed out last would
# run alone at the end. A stable sort: the order within a file and among the rest is kept.
LONGEST_FILES = ("test_world.py", "test_algorithms_learn.py", "test_slurm.py", "test_resume.py", "test_docs.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))
