"""Build a learner, train a step, save and resume a checkpoint, with every UserWarning and
FutureWarning shown (``-W always``): tests/test_learner.py reads what reached stderr."""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    from megatron_rl.checkpoint import load_checkpoint, save_checkpoint
    from megatron_rl.learner.learner import Learner
    from megatron_rl.learner.parallel import init_model_parallel
    from test_learner import VOCAB, _batch, _cfg

    init_model_parallel(1, 1, seed=0)
    learner = Learner(_cfg(), VOCAB)
    learner.train_step(_batch(), 1.0, lr=1e-2)
    root = Path(tempfile.mkdtemp())
    path = save_checkpoint(learner, root, step=1, trainer_state={})
    print("resuming", file=sys.stderr, flush=True)
    assert load_checkpoint(Learner(_cfg(), VOCAB), path)["step"] == 1
    print("resumed", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
