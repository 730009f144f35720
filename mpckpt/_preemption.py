"""Preemption signals: noticing that the job is about to be stopped, so the next save is its last.

Schedulers warn before they stop a job: SIGTERM (Kubernetes, SLURM's default, most clouds'
spot reclaim), or a signal of the user's choice some time ahead (SLURM ``--signal=USR1@120``).
``PreemptionWatch`` installs a handler for each of those signals that only sets a flag (what a
signal handler may safely do) and then calls the handler that was installed before it, if
that was a Python function: a framework's own handler keeps working. The default action of
the signal (termination) is *not* taken: stopping is the training loop's decision once it has
saved (``ckpt.preempted``). Closing the Checkpointer puts the previous handlers back.

Uploader processes ignore these signals (``worker``): a scheduler signals the whole process
group, and an uploader must live to write the last checkpoint. They still end with the trainer
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from typing import Any

from mpckpt.errors import ConfigError

# what uploaders ignore: signals a scheduler or a terminal sends to the whole job
JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def parse_signals(preemption: Any) -> tuple[signal.Signals, ...]:
    """``preemption=`` as a tuple of signals: False/None -> none, True -> SIGTERM, or a list."""
    if preemption is None or preemption is False:
        return ()
    if preemption is True:
        return (signal.SIGTERM,)
    items = [preemption] if isinstance(preemption, (int, str)) else preemption
    if not isinstance(items, Iterable):
        raise ConfigError(f"preemption={preemption!r}: give True, or a list of signals such as "
                          "[signal.SIGTERM, signal.SIGUSR1]")
    out = []
    for item in items:
        try:
            sig = signal.Signals[item.upper() if item.upper().startswith("SIG") else "SIG" + item.upper()] \
                if isinstance(item, str) else signal.Signals(item)
        except (KeyError, ValueError, AttributeError):
            raise ConfigError(f"preemption: {item!r} is not a signal; give e.g. signal.SIGTERM or 'SIGUSR1'") from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(f"preemption: {sig.name} cannot be caught; schedulers send SIGTERM or a signal "
                              "you choose (SLURM: --signal=USR1@120) before it")
        out.append(sig)
    if not out:
        raise ConfigError("preemption=[] names no signal; give True (SIGTERM) or a list of signals")
    return tuple(dict.fromkeys(out))


class PreemptionWatch:
    """Handlers that set ``preempted`` when one of ``signals`` arrives, chained to the previous ones."""

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
        self._event = threading.Event()
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def preempted(self) -> bool:
        return self._event.is_set()

    def install(self) -> None:
        if not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("preemption= installs signal handlers, which Python allows only in the main thread; "
                              "open the Checkpointer there, or leave preemption off and watch the signal yourself")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum)
        self._event.set()
        previous = self._previous.get(self.received)
        if callable(previous):  # a Python handler installed before ours; SIG_DFL/SIG_IGN are not called
            previous(signum, frame)

    def uninstall(self) -> None:
        """Put the previous handlers back (only from the main thread; elsewhere they stay)."""
        if not self._previous or threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:  # nobody installed another one over ours meanwhile
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
