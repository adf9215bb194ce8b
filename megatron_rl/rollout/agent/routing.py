"""Which agent run a model call belongs to, however the agent made its client.

A run's calls reach the chat server in one of three ways, all attributed to the run:

* the run's own base URL, ``http://127.0.0.1:<port>/runs/<run id>/v1`` (the ``client`` and
  ``base_url`` the trainer hands a run, ``openai_client()``, ``base_url()``);
* the shared URL ``http://127.0.0.1:<port>/v1`` with the run's key as the API key
  (``Authorization: Bearer megatron_rl-<run id>``, the ``api_key`` handed to a run, as AReaL's
  session keys are);
* the shared URL with no run in it, which is what a client built from the environment uses
  (``AsyncOpenAI()``: the trainer points ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` at the server
  while agents run). Environment variables are one per process, but many runs share the event
  loop, so the run travels in a context variable, which each asyncio task has its own copy of:
  ``httpx``/``httpx2`` clients (what ``openai``, ``anthropic`` and LangChain's OpenAI models send
  with) add the ``X-Megatron-RL-Run`` header to requests for the chat server made inside a run.
  Nothing else of theirs changes, and requests to any other address are left alone.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional

logger = logging.getLogger(__name__)

RUN_HEADER = "X-Megatron-RL-Run"
# The API key of a call that names no run by its key (the environment's, a shared client's).
SHARED_KEY = "megatron_rl"
RUN_KEY_PREFIX = SHARED_KEY + "-"


def run_key(run_id: str) -> str:
    """The API key that names ``run_id`` on the shared URL."""
    return RUN_KEY_PREFIX + run_id


def run_of_key(key: str) -> Optional[str]:
    """The run id a key names, or None for any other key."""
    return key[len(RUN_KEY_PREFIX):] if key.startswith(RUN_KEY_PREFIX) and len(key) > len(RUN_KEY_PREFIX) else None


@dataclass(frozen=True)
class RunAddress:
    """Where one run's calls go: the server's host and port, and the run."""

    host: str
    port: int
    run_id: str

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/runs/{self.run_id}/v1"

    @property
    def api_key(self) -> str:
        return run_key(self.run_id)


_CURRENT: contextvars.ContextVar[Optional[RunAddress]] = contextvars.ContextVar("megatron_rl_agent_run",
                                                                                default=None)


def current() -> Optional[RunAddress]:
    """The run this code runs in (None outside agent runs)."""
    return _CURRENT.get()


def enter(address: RunAddress) -> contextvars.Token:
    """Make ``address`` the current run of this task (and of the tasks it starts)."""
    return _CURRENT.set(address)


def leave(token: contextvars.Token) -> None:
    _CURRENT.reset(token)


def _tag(request) -> None:
    run = _CURRENT.get()
    if run is None or RUN_HEADER in request.headers:
        return
    url = request.url
    if url.host == run.host and url.port == run.port:
        request.headers[RUN_HEADER] = run.run_id


def _tagging(send: Callable, is_async: bool) -> Callable:
    if is_async:
        @functools.wraps(send)
        async def send_tagged(self, request, *args, **kwargs):
            _tag(request)
            return await send(self, request, *args, **kwargs)
    else:
        @functools.wraps(send)
        def send_tagged(self, request, *args, **kwargs):
            _tag(request)
            return send(self, request, *args, **kwargs)
    send_tagged.megatron_rl_tags_runs = True  # type: ignore[attr-defined]
    return send_tagged


def install_run_header() -> None:
    """Tag chat-server requests made inside a run, for every httpx flavour installed (once)."""
    for name in ("httpx2", "httpx"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for cls, is_async in ((module.AsyncClient, True), (module.Client, False)):
            if not getattr(cls.send, "megatron_rl_tags_runs", False):
                cls.send = _tagging(cls.send, is_async)


def point_environment(base_url: str) -> Callable[[], None]:
    """Point ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` at the chat server's shared URL; returns
    the function that puts back what was there."""
    wanted = {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": SHARED_KEY}
    before: Dict[str, Optional[str]] = {k: os.environ.get(k) for k in wanted}
    replaced = [k for k, v in before.items() if v is not None and v != wanted[k]]
    if replaced:
        logger.warning("agents: %s set in the environment replaced by the chat server's while agents run (a client "
                       "for another server needs its base_url and api_key given explicitly)", " and ".join(replaced))
    os.environ.update(wanted)

    def restore() -> None:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    return restore
