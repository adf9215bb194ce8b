"""The one way an expected failure reaches a user: ``<prog>: error: <what>, <where>, <how to fix>``
on one line of stderr and exit status 2, never a traceback.

Every error a user can act on (a config value, a data file, a checkpoint, the run directory, a
layout that cannot be placed) is a ``UserError``; the command-line entry points catch that one
class (``main.run_guarded``, ``exit_on_user_error``). Anything else is a bug and keeps its traceback.
This module imports nothing so that every layer can raise its errors from here."""

from __future__ import annotations

import difflib
import sys
from typing import Callable, Iterable, Optional, TypeVar

# The exit status of a command stopped by input it cannot use.
USAGE_EXIT = 2

T = TypeVar("T")


class UserError(ValueError):
    """A failure the user can fix; the message is one line: what, where, how to fix it."""


class ConfigError(UserError):
    """A config value that cannot work. The message is one line a user can act on.

    Here, not in config/, so that the packages owning a key's meaning raise it without importing
    the config package's checks."""


def one_line(err: BaseException) -> str:
    """An error's message on one line (a multi-line message is joined, never cut)."""
    return " ".join(part.strip() for part in str(err).splitlines() if part.strip()) or type(err).__name__


def report(err: BaseException, prog: str = "megatron_rl") -> int:
    """Print ``err`` as the one error line; returns the exit status for it."""
    print(f"{prog}: error: {one_line(err)}", file=sys.stderr, flush=True)
    return USAGE_EXIT


def exit_on_user_error(fn: Callable[[], T], prog: str = "megatron_rl") -> T:
    """Run ``fn``; a UserError leaves the process with the error line and status 2."""
    try:
        return fn()
    except UserError as err:
        sys.exit(report(err, prog))


def nearest(name: str, choices: Iterable[str]) -> Optional[str]:
    """The choice closest to a misspelled ``name`` (None when nothing is close)."""
    found = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None
