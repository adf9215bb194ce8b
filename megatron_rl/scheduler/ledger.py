"""Where every prompt is at any moment: queued, running, buffered (finished), consumed, or
returned to the queue. Nothing admitted is ever silently dropped: each admission (a Ticket)
ends exactly once, consumed by a training step or returned to be retried.

The ledger is pure bookkeeping (no asyncio, no model), so property tests can drive it through
any interleaving of finishes, failures and training steps.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence

from ..data.datasets import Prompt
from ..types import Trajectory
from .staleness import StalenessManager, schedulable

# What happens to a group that would be trained staler than η (``scheduler.overdue``):
# "wait": the learner waits for it, so no group is ever dropped for staleness and long responses
#   are trained as often as short ones;
# "retry": the group is dropped when its batch is formed and its prompt retried. The learner never
#   waits, but the groups dropped are those with the longest responses, so a long-tailed workload
#   trains shorter responses than it generates (a length bias) and wastes their generation.
OVERDUE_POLICIES = ("wait", "retry")


@dataclass
class Ticket:
    """One admission of one prompt (a group of rollouts)."""

    index: int          # admission order, unique
    prompt: Prompt
    version: int        # policy version when admitted
    attempt: int = 1


@dataclass
class FinishedGroup:
    ticket: Ticket
    trajectories: List[Trajectory]

    @property
    def oldest_version(self) -> int:
        """The version of the group's oldest token (the admission version if none were made)."""
        made = [t.oldest_version for t in self.trajectories if len(t.versions)]
        return min(made) if made else self.ticket.version


def max_ahead_groups(max_ahead_batches: float, groups_per_batch: int) -> int:
    """``scheduler.max_ahead_batches`` in groups (0: no limit). A fraction above one batch keeps
    that many more groups running while the learner trains, so the batch after it does not wait
    for its slowest group (1.5 with 16 groups per batch: 24 groups running or waiting). Below one
    batch no batch could ever fill: the config check refuses it."""
    if max_ahead_batches <= 0:
        return 0
    if max_ahead_batches < 1:
        raise ValueError(f"max_ahead_batches={max_ahead_batches} is below one batch: no batch would ever fill")
    return round(max_ahead_batches * groups_per_batch)


@dataclass
class PromptLedger:
    source: Iterator[Prompt]
    staleness: StalenessManager
    retry_queue: Deque[Prompt] = field(default_factory=deque)
    running: Dict[int, Ticket] = field(default_factory=dict)
    buffer: List[FinishedGroup] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    _next_index: int = 0
    # Admissions per prompt uid (a retried prompt is admitted again).
    attempts: Dict[str, int] = field(default_factory=dict)
    # At most this many groups running or finished-and-waiting at once (0: only the staleness
    # rule limits). Work generated further ahead of the learner cannot speed it up, it only ages:
    # with a learner slower than generation the buffer would otherwise fill to the full η.
    max_ahead_groups: int = 0
    # DAPO dynamic sampling: a finished group whose rewards are all equal carries no gradient
    # under group-relative advantages; it is dropped (counted as "filtered", not retried) and its
    # capacity goes to a new prompt, so batches stay full of informative groups.
    filter_equal_rewards: bool = False
    # Groups filtered since the last batch was taken (a run where every group is filtered is stuck).
    filtered_streak: int = 0
    # scheduler.overdue: one of OVERDUE_POLICIES.
    overdue: str = "wait"
    # The last take_batch had a batch's worth of finished groups but held it back, waiting for a
    # running group that would otherwise be trained staler than η.
    holding: bool = False

    def __post_init__(self) -> None:
        if self.overdue not in OVERDUE_POLICIES:
            raise ValueError(f"overdue={self.overdue!r}: choose one of {', '.join(OVERDUE_POLICIES)}")

    # -------------------------------------------------------------- admission
    def can_admit(self, version: int) -> bool:
        if self.max_ahead_groups and self.in_flight + len(self.buffer) >= self.max_ahead_groups:
            return False
        return self.staleness.capacity(version) > 0

    def admit(self, version: int) -> Optional[Ticket]:
        """Start a group if the staleness rule allows; retried prompts go first."""
        if not self.can_admit(version):
            return None
        if self.retry_queue:
            prompt = self.retry_queue.popleft()
        else:
            try:
                prompt = next(self.source)
            except StopIteration:
                return None
        attempt = self.attempts.get(prompt.uid, 0) + 1
        self.attempts[prompt.uid] = attempt
        ticket = Ticket(self._next_index, prompt, version, attempt)
        self._next_index += 1
        self.running[ticket.index] = ticket
        self.staleness.on_submit()
        self.counts["admitted"] += 1
        return ticket

    # -------------------------------------------------------------- outcomes
    def finish(self, ticket: Ticket, trajectories: Sequence[Trajectory]) -> None:
        self._release(ticket)
        if self.filter_equal_rewards and len({t.reward for t in trajectories}) <= 1:
            self.staleness.on_reject()
            self.counts["filtered"] += 1
            self.filtered_streak += 1
            return
        self.staleness.on_accept()
        self.buffer.append(FinishedGroup(ticket, list(trajectories)))
        self.counts["finished"] += 1

    def fail(self, ticket: Ticket, reason: str = "error") -> None:
        """The group could not be completed (engine died, request aborted): retry the prompt."""
        self._release(ticket)
        self.staleness.on_reject()
        self.retry_queue.append(ticket.prompt)
        self.counts["returned"] += 1
        self.counts[f"returned_{reason}"] += 1

    def take_batch(self, version: int) -> Optional[List[FinishedGroup]]:
        """B finished groups to train at ``version``, earliest deadline first (a group's deadline:
        its oldest token's version + η), none staler than η.

        Groups already too stale are evicted and their prompts retried. With ``overdue="wait"``
        none ever is: a batch is held back (None) while taking it would leave some running group
        unable to be trained in time, and is taken once that group has finished.
        """
        limit = self.staleness.max_staleness
        fresh = []
        for group in self.buffer:
            if version - group.oldest_version > limit:
                self.staleness.on_evict()
                self.retry_queue.append(group.ticket.prompt)
                self.counts["returned"] += 1
                self.counts["returned_stale"] += 1
            else:
                fresh.append(group)
        self.buffer = fresh
        self.holding = False
        size = self.staleness.groups_per_batch
        if len(self.buffer) < size:
            return None
        self.buffer.sort(key=lambda g: (g.oldest_version, g.ticket.index))
        batch, rest = self.buffer[:size], self.buffer[size:]
        if self.overdue == "wait" and self.running and not self._in_time(rest, version + 1):
            self.holding = True
            return None
        self.buffer = rest
        self.counts["consumed"] += size
        self.filtered_streak = 0
        return batch

    def _in_time(self, buffered: List[FinishedGroup], next_version: int) -> bool:
        """Whether ``buffered`` and every running group can still be trained within η from
        ``next_version`` on. A running group's oldest token is not known here; its admission
        version bounds it from below (nothing admitted starts on older weights)."""
        limit = self.staleness.max_staleness
        deadlines = [g.oldest_version + limit for g in buffered]
        deadlines += [t.version + limit for t in self.running.values()]
        return schedulable(deadlines, next_version, self.staleness.groups_per_batch)

    def _release(self, ticket: Ticket) -> None:
        if self.running.pop(ticket.index, None) is None:
            raise RuntimeError(f"ticket {ticket.index} ({ticket.prompt.uid}) is not running")

    # -------------------------------------------------------------- state
    @property
    def in_flight(self) -> int:
        return len(self.running)

    def balanced(self) -> bool:
        """Each admission is running, buffered, consumed, filtered or returned: exactly one."""
        c = self.counts
        return c["admitted"] == self.in_flight + len(self.buffer) + c["consumed"] + c["filtered"] + c["returned"]

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps (JSON-friendly). Groups running or finished but not yet trained
        are kept as prompts to do first after a resume (their rollouts are generated again), behind
        the prompts already waiting to be retried."""
        redo = ([t.prompt for _, t in sorted(self.running.items())]
                + [g.ticket.prompt for g in sorted(self.buffer, key=lambda g: g.ticket.index)])
        counts = Counter(self.counts)
        counts["returned"] += len(redo)
        counts["returned_resume"] += len(redo)
        return {
            "retry": [asdict(p) for p in list(self.retry_queue) + redo],
            "counts": dict(counts),
            "accepted": self.staleness.accepted - len(self.buffer),
            "next_index": self._next_index,
            "attempts": dict(self.attempts),
            "filtered_streak": self.filtered_streak,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if self.running or self.buffer or self.counts:
            raise RuntimeError("restore a ledger before it admits anything")
        self.retry_queue = deque(Prompt(**p) for p in state["retry"])
        self.counts = Counter(state["counts"])
        self.staleness.accepted = state["accepted"]
        self._next_index = state["next_index"]
        self.attempts = dict(state["attempts"])
        self.filtered_streak = state["filtered_streak"]
