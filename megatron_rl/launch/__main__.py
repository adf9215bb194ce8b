"""Entry point of a split world, the same command on a CPU box (gloo) and on GPU nodes (NCCL):

    torchrun --nproc-per-node 4 -m megatron_rl.launch recipe=tiny_cpu \\
        learner.tp=2 rollout.engines=2 rollout.placement=disaggregated
    python -m megatron_rl.launch --dry-run --world-size 16 --gpus-per-node 8 learner.tp=4 rollout.engines=8

``--dry-run`` prints the placement (role, Megatron coordinates, engine and weight-sync groups of
every rank) and exits; it needs no torchrun. An impossible layout exits with status 2 and one line
saying why and what would fit.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional

USAGE = """usage: [torchrun ...] python -m megatron_rl.launch [--dry-run] [--world-size N] [--gpus-per-node G]
                                    [recipe=tiny_cpu] [key=value ...]
  --dry-run          print the placement plan as a table and exit
  --world-size N     (dry run) the world to plan for; default: torchrun's WORLD_SIZE, else 1
  --gpus-per-node G  (dry run) default: torchrun's LOCAL_WORLD_SIZE, else the world size
  key=value          config overrides, e.g. learner.tp=2 rollout.engines=2 rollout.placement=disaggregated"""


def _parse(args: List[str]):
    dry_run, world, per_node, recipe, overrides = False, None, None, "tiny_cpu", []
    it = iter(args)
    for arg in it:
        if arg == "--dry-run":
            dry_run = True
        elif arg in ("--world-size", "--gpus-per-node"):
            value = int(next(it))
            world, per_node = (value, per_node) if arg == "--world-size" else (world, value)
        elif arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    return dry_run, world, per_node, recipe, overrides


def main(argv: Optional[List[str]] = None) -> int:
    from ..checks import WORLD, load_config
    from ..errors import ConfigError
    from ..config.load import recipe_name
    from ..errors import USAGE_EXIT, UserError, report
    from ..stop import record_exit
    from ..placement import plan_for

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    try:
        dry_run, world, per_node, recipe, overrides = _parse(args)
    except (StopIteration, ValueError):
        print("megatron_rl.launch: error: --world-size and --gpus-per-node take an integer (command line); "
              "e.g. --world-size 8 --gpus-per-node 8 (see --help)", file=sys.stderr)
        return 2
    world = int(os.environ.get("WORLD_SIZE", 1)) if world is None else world
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if per_node is None else per_node
    try:
        cfg = load_config(recipe, overrides, WORLD)
        cfg.trainer.recipe = recipe_name(recipe, cfg.trainer.recipe)
        plan = plan_for(cfg, world, per_node)
        if cfg.learner.cp > 1 and not dry_run:
            from ..models.gpt import te_available

            if not te_available():
                # megatron-core's local attention asserts context_parallel_size == 1.
                raise ConfigError(f"learner.cp={cfg.learner.cp} needs TransformerEngine's attention (CUDA); "
                                  "megatron-core's local attention has no context parallelism: use learner.cp=1")
    except UserError as err:  # ConfigError, PlacementError
        if dry_run or os.environ.get("RANK", "0") == "0":
            return record_exit(report(err, "megatron_rl.launch"))
        return USAGE_EXIT  # every rank finds the same error: rank 0 alone prints it
    if dry_run:
        print(plan.table())
        return 0
    if world == 1:
        from ..main import main as single_process_main

        return single_process_main([f"recipe={recipe}", *overrides])
    return _run(cfg, plan, per_node)


def _run(cfg, plan, per_node: int) -> int:
    import faulthandler
    import signal
    from datetime import timedelta

    import torch

    from ..learner.parallel import destroy, init_distributed
    from ..main import run_guarded
    from ..stop import STOPPED_EXIT
    from ..lifetime import available_cores, die_with_parent
    from ..telemetry.run_dir import setup_logging
    from .run import run_split_world

    # A rank dies with its torchrun agent: a job killed with SIGKILL leaves no rank behind.
    die_with_parent(os.getppid())
    setup_logging()  # every rank: log format, and megatron's expected CPU fallback warnings quiet
    # `kill -USR2 <pid>` prints where a rank's threads are: the first thing to ask of a hung job
    # (SIGUSR1 is a stop request).
    faulthandler.register(signal.SIGUSR2, all_threads=True)

    if not torch.cuda.is_available():
        # CPU: share the cores of this node among its ranks (one OpenMP team each).
        cores = cfg.trainer.cpu_threads or available_cores()
        torch.set_num_threads(max(1, cores // per_node))
    # torchrun's env:// rendezvous; NCCL on GPUs, gloo on CPU
    init_distributed(timeout=timedelta(seconds=cfg.trainer.rank_timeout_s))
    rc = run_guarded(lambda: run_split_world(cfg, plan), prog="megatron_rl.launch")
    if rc not in (0, STOPPED_EXIT):
        # A failed world: a thread may be stuck in a collective with a dead rank, and the
        # interpreter would wait for it at exit. The error line is out; leave now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    destroy()
    return rc


if __name__ == "__main__":
    from megatron_rl.lifetime import skip_final_gc

    skip_final_gc()  # first: its atexit handler must run last
    sys.exit(main())
