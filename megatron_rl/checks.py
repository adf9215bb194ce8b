"""A whole config, resolved and checked: the config's own checks (config/validate.py) and each
owning package's checks of its keys, in one order, so the first bad key is the one reported.

This module sits above the packages whose keys it checks (models, data, algorithms, learner,
rollout, rewards, telemetry); they and config/ import nothing from it. Entry points load a
config here (``load_config``); a config built in code is checked with ``validate``."""

from __future__ import annotations

from typing import Callable, Dict, Sequence, Tuple, Union

from .algorithms.advantages import ADVANTAGE_ESTIMATORS
from .algorithms.policy_loss import LOSS_AGG_MODES, POLICY_LOSSES
from .algorithms.rollout_correction import IS_LEVELS, REJECT_LEVELS, check_correction
from .config import validate as own
from .config.load import compose_config
from .config.schema import RootConfig
from .config.validate import ONE_PROCESS, PLACEMENTS, WORLD, validate_eval
from .data.arithmetic import check_arithmetic
from .data.sources import check_sources
from .errors import ConfigError, UserError
from .learner.recipes import LEARNER_RECIPES, check_group_size, check_teacher
from .models.families import FAMILY_NAMES, check_family
from .models.layout import check_layouts
from .models.lora import LORA_SYNCS, check_lora
from .models.routing import check_routing_replay, routing_replay_on
from .models.shared_prefix import check_share_prompts
from .plugins import is_import_path
from .rewards.user import check_user_reward
from .rewards.verifiers import REWARDS
from .rollout.build import ENGINES, engine_entry
from .rollout.workflow import check_workflow, workflow_names
from .scheduler.ledger import OVERDUE_POLICIES
from .telemetry.trackers import check_trackers

__all__ = ["ALLOWED", "ONE_PROCESS", "PLACEMENTS", "WORLD", "allowed", "load_config", "routing_replay_on", "validate",
           "validate_eval"]

# key -> its values, or a function returning them: a registry's names are read at each check,
# so a component registered after this module was imported is a valid value.
ALLOWED: Dict[str, Union[Tuple[str, ...], Callable[[], Tuple[str, ...]]]] = {
    "model.family": FAMILY_NAMES,
    "model.dtype": ("fp32", "bf16"),
    "model.moe_token_dispatcher": ("alltoall", "allgather"),
    "model.moe_router_score_function": ("softmax", "sigmoid"),
    "lora.sync": LORA_SYNCS,
    "rollout.engine": ENGINES.names,
    "rollout.workflow": workflow_names,
    "rollout.placement": ("colocated", "disaggregated"),
    "algo.name": lambda: ADVANTAGE_ESTIMATORS.names() + LEARNER_RECIPES.names(),
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.policy_loss": POLICY_LOSSES.names,
    "algo.behav_weight_level": ("token", "sequence"),
    "algo.loss_agg_mode": LOSS_AGG_MODES,
    "algo.routing_replay": ("auto", "rollout", "none"),
    "correction.is_level": IS_LEVELS,
    "correction.reject": REJECT_LEVELS,
    "learner.lr_decay_style": ("constant", "linear", "cosine"),
    "data.name": ("reverse_digits", "sort_digits", "arithmetic", "file", "gsm8k", "math500", "jsonl"),
    "data.template": ("plain", "qa", "math", "chat"),
    "data.tokenizer": ("auto", "char", "bpe", "model"),
    "reward.name": REWARDS.names,
    "sandbox.mode": ("auto", "bubblewrap", "namespaces+rlimits", "rlimits"),
    "scheduler.overdue": OVERDUE_POLICIES,
}


def allowed(key: str) -> Tuple[str, ...]:
    """The values config key ``key`` accepts now."""
    choices = ALLOWED[key]
    return choices() if callable(choices) else choices


def _choices(cfg: RootConfig) -> None:
    for key in ALLOWED:
        if key == "rollout.workflow" and is_import_path(cfg.rollout.workflow):
            continue  # a user's agent: loaded and checked by check_workflow
        own.check_choice(cfg, key, allowed(key))


def validate(cfg: RootConfig, placement: str = ONE_PROCESS) -> RootConfig:
    """Check every value of a resolved config; raise ConfigError naming the first bad key.

    ``placement``: where the run's processes are, ``ONE_PROCESS`` (``python -m megatron_rl.main``)
    or ``WORLD`` (``python -m megatron_rl.launch`` under torchrun, whose planner checks the sizes
    of multi-rank learners and engines). A key means the same in both or is refused with one line
    naming the placement."""
    own.check_finite(cfg)
    own.check_reward_bounds(cfg)
    _choices(cfg)
    own.check_placement(cfg, placement)
    check_trackers(cfg.trainer.loggers)
    check_workflow(cfg.rollout)
    own.check_positives(cfg)
    own.check_model_shape(cfg)
    check_family(cfg.model)
    own.check_moe_layer_pattern(cfg)
    own.check_top_p(cfg)
    own.check_long_tail(cfg)
    check_group_size(cfg)
    own.check_batch_split(cfg)
    check_correction(cfg)
    check_teacher(cfg)
    check_lora(cfg)
    own.check_coefficients(cfg)
    own.check_data_digits(cfg)
    check_share_prompts(cfg)
    check_sources(cfg.data)
    if cfg.data.name == "arithmetic":
        check_arithmetic(cfg.data)
    own.check_context(cfg)
    own.check_eval(cfg)
    check_layouts(cfg)  # the layouts the placement planner will place fit the model's shape
    check_routing_replay(cfg)
    own.check_weight_sync(cfg)
    check_user_reward(cfg.reward)
    engine_entry(cfg).check(cfg, placement)  # the engine's own settings, where it will run
    return cfg


def resolve(cfg: RootConfig, placement: str = ONE_PROCESS) -> RootConfig:
    """A typed config (``config.to_dataclass``) made whole and checked: model.path's architecture
    replaces the recipe's model sizes, data.tokenizer=auto is chosen, then ``validate``."""
    from .data.build import choose_tokenizer
    from .models.pretrained import resolve_model_config

    try:  # model.path: the checkpoint's architecture replaces the recipe's model sizes
        cfg.model = resolve_model_config(cfg.model)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    try:  # data.tokenizer=auto becomes the checkpoint's (model) or the dataset's own: config.yaml says which
        cfg.data.tokenizer = choose_tokenizer(cfg)
    except UserError as err:
        raise ConfigError(str(err)) from None
    return validate(cfg, placement)


def load_config(recipe: str = "tiny_cpu", overrides: Sequence[str] = (), placement: str = ONE_PROCESS) -> RootConfig:
    """The recipe ``recipe`` names (a name in the recipe folders, or a ``.yaml`` file) with
    command-line style overrides, as the CLI composes it, resolved and checked (ConfigError names
    the first bad key). Relative paths in it come out absolute, from the working directory.
    ``placement``: ``ONE_PROCESS`` (default) or ``WORLD``, as in ``validate``."""
    return resolve(compose_config(recipe, overrides), placement)
