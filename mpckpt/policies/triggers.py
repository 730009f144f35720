"""Save triggers: objects that decide whether a step is due for a checkpoint.

``Checkpointer(root, trigger=EveryNSteps(500) | EveryNSeconds(1800))``: then ``save(step, state)``
saves only when the trigger says the step is due (else it returns None at once, having copied
nothing), ``should_save(step)`` asks the same question without saving, and
``save(..., force=True)`` saves regardless. Without a trigger every ``save`` saves.

A trigger sees the step, the last step saved and when (``None`` before the first save: then the
clock starts when the checkpointer opened), and the time now; it reads no clock of its own, so
it is tested without one. Triggers combine with ``|``: due when any part is due.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

from mpckpt.errors import ConfigError


@dataclass(frozen=True)
class Moment:
    """What a trigger decides from: the step asked about, the last save, and now (seconds)."""

    step: int
    last_step: int | None
    last_time: float
    now: float


class Trigger(abc.ABC):
    """Whether a step is due for a checkpoint; subclasses implement ``due``."""

    @abc.abstractmethod
    def due(self, moment: Moment) -> bool:
        """True if a checkpoint should be saved at ``moment.step``."""

    def __or__(self, other: Trigger) -> Trigger:
        if not isinstance(other, Trigger):
            return NotImplemented
        return AnyTrigger(self, other)


class AnyTrigger(Trigger):
    """Due when any of ``triggers`` is (what ``a | b`` builds)."""

    triggers: tuple[Trigger, ...]

    def __init__(self, *triggers: Trigger) -> None:
        flat: list[Trigger] = []
        for trigger in triggers:
            flat.extend(trigger.triggers if isinstance(trigger, AnyTrigger) else [trigger])
        self.triggers = tuple(flat)

    def due(self, moment: Moment) -> bool:
        return any(t.due(moment) for t in self.triggers)

    def __repr__(self) -> str:
        return " | ".join(repr(t) for t in self.triggers)


class EveryNSteps(Trigger):
    """Due at every step that is a multiple of ``n`` (steps 0, n, 2n, ...)."""

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"EveryNSteps(n={n!r}) needs a whole number of at least 1")
        self.n = n

    def due(self, moment: Moment) -> bool:
        return moment.step % self.n == 0

    def __repr__(self) -> str:
        return f"EveryNSteps({self.n})"


class EveryNSeconds(Trigger):
    """Due once ``seconds`` have passed since the last save (or since the checkpointer opened)."""

    def __init__(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
            raise ConfigError(f"EveryNSeconds(seconds={seconds!r}) needs a positive, finite number of seconds")
        self.seconds = float(seconds)

    def due(self, moment: Moment) -> bool:
        return moment.now - moment.last_time >= self.seconds

    def __repr__(self) -> str:
        return f"EveryNSeconds({self.seconds:g})"


def check_trigger(trigger: Any) -> Trigger | None:
    """``trigger`` if it is one (or None); a ``ConfigError`` naming ``trigger`` otherwise."""
    if trigger is None or isinstance(trigger, Trigger):
        return trigger
    raise ConfigError(f"trigger={trigger!r} is not a save trigger; give one such as mpckpt.EveryNSteps(500), "
                      "or several combined with |: mpckpt.EveryNSteps(500) | mpckpt.EveryNSeconds(1800)")


class Schedule:
    """A checkpointer's trigger and its memory of the last save (opened at ``opened``, monotonic s)."""

    def __init__(self, trigger: Trigger | None, *, opened: float) -> None:
        self.trigger = trigger
        self.last_step: int | None = None
        self.last_time = opened

    def due(self, step: int, now: float) -> bool:
        """Whether ``step`` is due (always, without a trigger)."""
        return self.trigger is None or self.trigger.due(Moment(step, self.last_step, self.last_time, now))

    def saved(self, step: int, now: float) -> None:
        self.last_step, self.last_time = step, now

    @property
    def timed(self) -> bool:
        """Whether the trigger looks at the clock (ranks of a job may then disagree)."""
        pending: list[Any] = [self.trigger]
        while pending:
            t = pending.pop()
            if isinstance(t, EveryNSeconds):
                return True
            pending.extend(getattr(t, "triggers", ()))
        return False
