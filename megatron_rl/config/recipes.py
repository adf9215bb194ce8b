"""Where recipes are found: a file named by its path, or a name looked up in the recipe folders
(the folders of ``MEGATRON_RL_RECIPE_PATH``, then the project's ``recipes/``).

Every folder is also on Hydra's search path while a recipe is composed, so a recipe of one's own
can start from a shipped one (``defaults: [tiny_cpu, _self_]``) or from a sibling file, as a
Hydra user would write it; ``hydra.searchpath`` in a recipe adds folders the Hydra way."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Sequence, Tuple

from ..errors import ConfigError, nearest

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
# Folders of one's own recipes, searched before recipes/ (separated like PATH: ':' on Linux).
RECIPE_PATH_ENV = "MEGATRON_RL_RECIPE_PATH"


def recipe_dirs() -> List[Path]:
    """The recipe folders, searched in order: ``MEGATRON_RL_RECIPE_PATH``'s (relative ones from
    the working directory), then the project's ``recipes/``."""
    dirs = [Path(p).expanduser().resolve() for p in os.environ.get(RECIPE_PATH_ENV, "").split(os.pathsep) if p]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise ConfigError(f"{RECIPE_PATH_ENV} names {', '.join(missing)}, which is not a directory: give "
                          f"folders of recipe .yaml files, separated by '{os.pathsep}'")
    return list(dict.fromkeys([*dirs, RECIPES_DIR]))


def recipe_names(dirs: Sequence[Path]) -> List[str]:
    return sorted({p.stem for d in dirs for p in d.glob("*.yaml")})


def is_recipe_file(recipe: str) -> bool:
    """Whether ``recipe=`` names a file (``.yaml``, or ``.yml``, which Hydra cannot compose and
    is refused by name) rather than a recipe name."""
    return recipe.endswith((".yaml", ".yml"))


def recipe_location(recipe: str) -> Tuple[List[Path], str]:
    """(search path, config name) of a recipe: the search path's first folder holds it, the
    recipe folders follow. ``recipe`` is a name (``tiny_cpu``, or ``group/name`` for a file in a
    recipe folder's subfolder) or the path of a ``.yaml`` file (one's own recipe, or a run's
    ``config.yaml``), relative to the working directory."""
    dirs = recipe_dirs()
    if is_recipe_file(recipe):
        if recipe.endswith(".yml"):
            raise ConfigError(f"recipe={recipe}: Hydra reads recipes ending in .yaml only: rename it to "
                              f"{recipe[:-len('.yml')]}.yaml")
        path = Path(recipe).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"recipe={recipe}: file not found (from {Path.cwd()}); give the path of a recipe "
                              ".yaml file (or a run's config.yaml), or a recipe name: " + ", ".join(recipe_names(dirs)))
        return list(dict.fromkeys([path.parent, *dirs])), path.name[:-len(".yaml")]
    for folder in dirs:
        if (folder / f"{recipe}.yaml").is_file():
            return list(dict.fromkeys([folder, *dirs])), recipe
    names = recipe_names(dirs)
    guess = nearest(recipe, names)
    where = ", ".join(str(d) for d in dirs)
    raise ConfigError(f"recipe={recipe} not found (no {recipe}.yaml in {where}): "
                      + (f"did you mean recipe={guess}? " if guess else "")
                      + f"the recipes are {', '.join(names)}; a recipe of your own: recipe=path/to/file.yaml, "
                      f"or its folder in {RECIPE_PATH_ENV}")


def recipe_name(recipe: str, loaded: str) -> str:
    """What ``trainer.recipe`` (which names the default run directory) becomes for ``recipe=``: the
    name; for a file, the recipe it records (a run's config.yaml), else the file's stem."""
    if not is_recipe_file(recipe):
        return recipe
    return loaded if loaded and loaded != "custom" else Path(recipe).name[:-len(".yaml")]


@contextmanager
def hydra_search_path(dirs: Sequence[Path]) -> Iterator[None]:
    """Hydra initialised with ``dirs`` as its config search path, in order (Hydra's
    ``initialize_config_dir`` takes one folder): the first holds the primary recipe, the others
    are where its defaults list is looked up. A recipe's own ``hydra.searchpath`` comes after."""
    from hydra import initialize_config_dir

    # hydra-core 1.3's search path object: what initialize_config_dir builds, plus our folders
    # ahead of the structured-config entry that closes it.
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.global_hydra import GlobalHydra

    with initialize_config_dir(config_dir=str(dirs[0]), version_base=None):
        search_path = create_config_search_path(search_path_dir=str(dirs[0]))
        for folder in dirs[1:]:
            search_path.prepend("megatron_rl", str(folder), anchor="schema")
        GlobalHydra.instance().clear()  # the context restores what was there before on exit
        Hydra.create_main_hydra2(task_name="app", config_search_path=search_path)
        yield
