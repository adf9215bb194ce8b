"""Command line: ``python -m megatron_rl.main [recipe=NAME] [key=value ...]``.

Recipes are Hydra YAMLs under recipes/ composed onto the structured schema; any key can be
overridden (``trainer.total_steps=50 algo.group_size=8``). Errors in config or data print one
line naming the problem and exit with status 2.
"""

from __future__ import annotations

import json
import sys
from typing import Callable, List, Optional

USAGE = """usage: python -m megatron_rl.main [recipe=tiny_cpu] [--print-config] [key=value ...]
  recipe=NAME      a YAML under recipes/ (default tiny_cpu)
  --print-config   print the resolved config and exit
  key=value        any config override, e.g. trainer.total_steps=50 algo.group_size=8"""


def run_guarded(run: Callable[[], Optional[dict]], prog: str = "megatron_rl") -> int:
    """Run a trainer; errors a user can act on become one line on stderr and an exit status:
    2 for config, data and resume errors, 1 for a run that had to stop (an engine or a rank
    gone), ``STOPPED_EXIT`` for a stop on request (checkpoint written)."""
    from .checkpoint.resume import ResumeError
    from .config import ConfigError
    from .data.datasets import DatasetError
    from .learner.group import LearnerRanksFailed
    from .plugins import PluginError
    from .scheduler.controller import RolloutsStopped
    from .stop import STOPPED_EXIT, StopRequested

    try:
        summary = run()
    except (ConfigError, DatasetError, ResumeError, PluginError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except (RolloutsStopped, LearnerRanksFailed) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    except StopRequested as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return STOPPED_EXIT
    if summary is not None:
        print(json.dumps(summary))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    from .config import ConfigError, load_config

    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    recipe = "tiny_cpu"
    print_only = "--print-config" in args
    overrides = []
    for arg in args:
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        elif arg != "--print-config":
            overrides.append(arg)
    try:
        cfg = load_config(recipe, overrides)
    except ConfigError as err:
        print(f"megatron_rl: error: {err}", file=sys.stderr)
        return 2
    cfg.trainer.recipe = recipe
    if print_only:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        return 0

    def run():
        from .trainer import Trainer

        return Trainer(cfg).run()

    return run_guarded(run)


if __name__ == "__main__":
    sys.exit(main())
