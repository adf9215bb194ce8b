"""The frozen teachers of on-policy distillation (algo.name=opd) and which row each one scores.

One teacher (``teacher.path``) scores every row. Several (``teacher.paths``: name -> checkpoint)
are chosen per row by a dataset field (``teacher.field``, e.g. ``data_source``), with
``teacher.default`` for rows that do not name one: the driver reads the name from each group's
prompt row (``row_teacher``), the learner ranks receive one name per group and score each
teacher's rows with that teacher alone (``teacher_logprobs``). Each teacher is built once, frozen,
with its own architecture and the learner's parallel layout, and must share the student's
vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

import torch

from ..config.schema import RootConfig, TeacherConfig
from ..data.files import DatasetError
from ..types import Trajectory

if TYPE_CHECKING:
    from .train_batch import TrainBatch

# The name of the one teacher of teacher.path (named teachers take their teacher.paths keys).
SOLE = "teacher"


def teacher_checkpoints(tc: TeacherConfig) -> Dict[str, str]:
    """Each teacher's name and checkpoint: teacher.paths, or teacher.path under ``SOLE``."""
    if tc.paths:
        return dict(tc.paths)
    return {SOLE: tc.path} if tc.path else {}


def build_teacher(cfg: RootConfig, vocab_size: int, path: str, key: str = "teacher.path") -> torch.nn.Module:
    """The frozen teacher at ``path`` (the config key ``key`` gave it) with the learner's parallel
    layout and dtype; its vocabulary must be the student's (ConfigError otherwise)."""
    from ..config.schema import ModelConfig
    from ..errors import ConfigError
    from ..models.convert import pretrained_model_config
    from ..models.gpt import build_gpt_model
    from ..models.grouped_moe import stack_expert_parameters
    from ..models.pretrained import load_pretrained, resolve_model_config

    try:
        model_cfg = resolve_model_config(ModelConfig(path=path, dtype=cfg.model.dtype))
        _, teacher_vocab = pretrained_model_config(path, cfg.model.dtype)
    except ValueError as err:
        raise ConfigError(str(err).replace("model.path", key)) from None
    if teacher_vocab != vocab_size:
        raise ConfigError(f"{key}={path!r} has a vocabulary of {teacher_vocab} ids and the student "
                          f"{vocab_size}: distillation compares the two token by token, so they need one tokenizer "
                          "(a teacher of the student's family, or model.path at a checkpoint with the teacher's)")
    lc = cfg.learner
    teacher = build_gpt_model(model_cfg, vocab_size, tp=lc.tp, pp=lc.pp, ep=lc.ep)
    load_pretrained(teacher, model_cfg, path)
    stack_expert_parameters(teacher)  # its forwards then read the experts' weights in place
    return teacher.requires_grad_(False).eval()


def build_teachers(cfg: RootConfig, vocab_size: int) -> Dict[str, torch.nn.Module]:
    """Every teacher of the config by name (none without distillation), each built once."""
    tc = cfg.teacher
    key = "teacher.paths.{}" if tc.paths else "teacher.path"
    return {name: build_teacher(cfg, vocab_size, path, key.format(name))
            for name, path in teacher_checkpoints(tc).items()}


def row_teacher(row: Mapping[str, Any], tc: TeacherConfig, where: str) -> Optional[str]:
    """The teacher of one dataset row (``where`` names it in errors): the value of its
    teacher.field, teacher.default when the row has none, None with a single teacher."""
    if not tc.paths:
        return None
    name = row.get(tc.field)
    if name is None or name == "":
        if tc.default is None:
            raise DatasetError(f"{where}: row field {tc.field!r} (teacher.field) is missing or empty, so no teacher "
                               f"scores it; give the row one of {', '.join(sorted(tc.paths))}, or set teacher.default")
        return tc.default
    if not isinstance(name, str) or name not in tc.paths:
        raise DatasetError(f"{where}: row field {tc.field!r} (teacher.field) is {name!r}, not a teacher of "
                           f"teacher.paths (names: {', '.join(sorted(tc.paths))}); add it to teacher.paths or fix "
                           "the row")
    return name


def check_row_teachers(prompts: Iterable[Any], tc: TeacherConfig) -> None:
    """Before any rollout: every row of a dataset held in memory (a file's prompts, each source
    of a mixture) has a teacher (DatasetError, one line, for the first that has none). Prompts
    drawn without end (the synthetic tasks) are checked as they are trained on."""
    if not tc.paths:
        return
    for source in getattr(prompts, "sources", None) or [prompts]:
        for prompt in getattr(source, "prompts", ()):
            row_teacher(prompt.row, tc, f"prompt {prompt.uid}")


def teacher_logprobs(batch: "TrainBatch", score: Callable[[Sequence[Trajectory], str], List[List[float]]],
                     ) -> List[List[float]]:
    """Per response token of each trajectory, its own teacher's logprob: ``score(trajs, name)``
    runs teacher ``name`` over ``trajs``, once per teacher on the rows it scores. Collective over
    the learner ranks (each holds the same batch, so each runs the same passes in the same order)."""
    if not batch.teachers:
        return score(batch, SOLE)
    from .data_parallel import LocalRows, dp_size_rank

    dp, _ = dp_size_rank()
    out: List[Optional[List[float]]] = [None] * len(batch)
    # A replica's share: each replica scores its own rows, with every teacher of the step (the
    # same passes on every rank, a teacher of none of its rows over none).
    names = sorted(set(batch.index.teachers if batch.local and batch.index is not None else batch.teachers))
    for name in names:
        rows = [i for i, t in enumerate(batch.teachers) if t == name]
        trajs = [batch[i] for i in rows]
        if batch.local:
            scored = score(LocalRows(trajs), name)
        else:
            # Every data-parallel replica takes a share of the pass: a teacher of fewer rows than
            # replicas scores them repeated, and the repeats are dropped.
            scored = score((trajs * dp)[: max(len(trajs), dp)], name)
        for i, logprobs in zip(rows, scored):
            out[i] = logprobs
    return out  # type: ignore[return-value]
