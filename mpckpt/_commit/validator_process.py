"""The validator process: runs the user's ``validate`` function on committed checkpoints.

One long-lived process per Checkpointer, started when the first validation is due, from the
same ``multiprocess`` context as the uploaders (the fork server by default): it neither
inherits the training process's memory or CUDA state nor imports the user's main script
(``_system/spawn.py``). The function travels as dill bytes made with ``recurse=True``: a
function of an importable module is found again by its module; a function, lambda or
closure of the main script (or a notebook) comes by value, with the globals it uses.
``pickle_fn`` makes those bytes when the Checkpointer opens, so a function that cannot travel
is a ``ConfigError`` there, not a failure at the first commit.

Messages (trainer -> validator): ``("validate", step, name, manifest)`` and ``("stop",)``.
Answers: ``("started", step, None)`` as ``fn`` is called (``validate_timeout_s`` counts from
there, not from a new process's start), then ``("ok", step, metrics)``, the metrics already
checked to be numbers (``format.validation.numeric_metrics``), or ``("err", step, RemoteFailure)``.

The process takes the trainer's environment of the moment the Checkpointer opened, is named
``mpckpt-validator <root>`` in ps/top, runs ``nice`` below the trainer (no ``SCHED_IDLE``: an
evaluation must finish on a busy machine too), ignores the job signals a scheduler sends to
the whole group, as uploaders do, and exits when the trainer is gone. It is not daemonic,
so ``fn`` may start processes of its own (a ``DataLoader`` with workers);
``ValidatorProcess.close`` stops it, killing it if it does not stop.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dill
from multiprocess.connection import wait as mp_wait

from mpckpt._preemption import JOB_SIGNALS
from mpckpt._system.processes import RemoteFailure, process_alive, set_title
from mpckpt._system.spawn import VALIDATOR_NAME, uploader_context
from mpckpt._threads import Thread
from mpckpt.errors import ConfigError, add_note
from mpckpt.format.manifest import Manifest
from mpckpt.storage import BackendSpec

_POLL_S = 0.5
START_ALLOWANCE_S = 300.0  # a new process's start (imports, rebuilding fn) is not the validation's time


def pickle_fn(fn: Any) -> bytes:
    """``fn`` as the bytes the validator process rebuilds it from; ``ConfigError`` if it cannot travel."""
    if not callable(fn):
        raise ConfigError(f"validate={fn!r} is not callable; give a function fn(checkpoint) -> dict of metrics")
    try:
        return bytes(dill.dumps(fn, recurse=True))
    except Exception as e:
        raise ConfigError(
            f"validate={fn!r} cannot be sent to the validator process ({type(e).__name__}: {e}); it runs in a "
            "separate process, so it must be picklable by dill: a module-level function, or a function, lambda "
            "or closure whose captured values pickle (open models, files and locks inside the function)") from e


@dataclass(frozen=True)
class ValidatorSetup:
    """What the validator process needs: where the checkpoints are, the function, as whom it runs."""

    spec: BackendSpec
    fn: bytes
    nice: int
    trainer_pid: int
    environ: dict[str, str] | None = None


class ValidationFailed(Exception):
    """One validation did not produce metrics; ``cause`` says why (``crashed``: the process is gone)."""

    def __init__(self, message: str, *, cause: BaseException | None = None, crashed: bool = False) -> None:
        super().__init__(message)
        self.__cause__ = cause
        self.crashed = crashed


class ValidatorProcess:
    """The trainer's handle on one validator process: start it, run one validation, stop it."""

    def __init__(self, setup: ValidatorSetup, *, start_method: str) -> None:
        self.setup = setup
        ctx = uploader_context(start_method)
        self._conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=validator_main, args=(child, setup), daemon=False,
                                   name=f"{VALIDATOR_NAME} {setup.spec.root}")
        self.process.start()
        child.close()

    @property
    def pid(self) -> int:
        return int(self.process.pid)

    def validate(self, step: int, name: str, manifest: Manifest, *, timeout_s: float,
                 abandoned: Callable[[], bool]) -> dict[str, Any]:
        """The metrics of ``fn`` for checkpoint ``name``, or ``ValidationFailed`` (the cause chained).

        ``timeout_s`` counts from the moment ``fn`` is called (the process says so): a process
        that is still starting gets ``START_ALLOWANCE_S`` more. A process that dies, or is still
        running past its deadline (then killed), or while ``abandoned()`` becomes true, fails with
        ``crashed``: the caller starts a new one for the next.
        """
        try:
            self._conn.send(("validate", step, name, manifest))
        except (OSError, ValueError) as e:
            raise self._died("before it was given the checkpoint") from e
        deadline, started = time.monotonic() + timeout_s + START_ALLOWANCE_S, False
        while True:
            ready = mp_wait([self._conn, self.process.sentinel], timeout=_POLL_S)
            if self._conn in ready:
                try:
                    status, _, payload = self._conn.recv()
                except (EOFError, OSError):
                    raise self._died("while validating") from None
                if status == "started":
                    deadline, started = time.monotonic() + timeout_s, True
                    continue
                if status == "ok":
                    return dict(payload)
                cause = _rebuild(payload)
                raise ValidationFailed(f"validate= raised {type(cause).__name__}: {cause}", cause=cause)
            if ready:  # the sentinel alone: the process ended without an answer
                raise self._died("while validating")
            if abandoned():
                self.kill()
                raise ValidationFailed("the Checkpointer was closed before the validation finished", crashed=True)
            if time.monotonic() > deadline:
                self.kill()
                what = (f"validate= did not finish within validate_timeout_s={timeout_s:g}" if started else
                        f"the validator process did not start within {START_ALLOWANCE_S + timeout_s:g}s")
                raise ValidationFailed(f"{what}; the process was stopped", crashed=True)

    def _died(self, when: str) -> ValidationFailed:
        self.process.join(5)
        code = self.process.exitcode
        how = f"killed by signal {-code}" if isinstance(code, int) and code < 0 else f"exit code {code}"
        return ValidationFailed(f"the validator process died {when} ({how})", crashed=True)

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)

    def close(self, *, timeout_s: float = 5.0) -> None:
        """Ask the process to stop; kill it if it has not within ``timeout_s``."""
        try:
            self._conn.send(("stop",))
        except (OSError, ValueError):
            pass
        self.process.join(timeout_s)
        self.kill()
        self._conn.close()


def _rebuild(payload: Any) -> BaseException:
    if not isinstance(payload, RemoteFailure):
        return RuntimeError(str(payload))
    exc = payload.exc if payload.exc is not None else RuntimeError(f"{payload.type_name}: {payload.message}")
    exc.__traceback__ = None
    add_note(exc, f"raised in the mpckpt validator process:\n{payload.remote_traceback.rstrip()}")
    return exc


# -- the process itself -----------------------------------------------------------------------
def _exit_with_trainer(pid: int) -> None:
    """With the fork server our parent is the server: watch the trainer itself, even while ``fn`` runs."""
    while process_alive(pid):
        time.sleep(1.0)
    os._exit(1)


def _become_validator(setup: ValidatorSetup) -> None:
    for sig in JOB_SIGNALS:  # the trainer decides when to stop; we end with it anyway
        signal.signal(sig, signal.SIG_IGN)
    set_title(f"{VALIDATOR_NAME} {setup.spec.root}")
    if setup.environ is not None:
        os.environ.clear()
        os.environ.update(setup.environ)
    try:
        os.nice(setup.nice)
    except OSError:
        pass
    Thread(target=_exit_with_trainer, args=(setup.trainer_pid,), name="mpckpt-trainer-watch",
                     daemon=True).start()


def validator_main(conn: Any, setup: ValidatorSetup) -> None:
    """Entry point of the validator process: validations one at a time, until told to stop."""
    from mpckpt.checkpoint import Checkpoint
    from mpckpt.format.validation import numeric_metrics
    from mpckpt.storage import open_backend

    _become_validator(setup)
    startup: RemoteFailure | None = None
    try:
        fn = dill.loads(setup.fn)
        backend = open_backend(setup.spec)
    except BaseException as e:  # reported with every validation asked for, never swallowed
        error = ConfigError(f"validate= could not be rebuilt in the validator process ({type(e).__name__}: {e}); "
                            "it runs without your main script: a function of another module must be importable "
                            "there, and what it captures must unpickle")
        error.__cause__ = e
        startup = RemoteFailure.capture(error)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] != "validate":
            return
        _, step, name, manifest = msg
        if startup is not None:
            conn.send(("err", step, startup))
            continue
        conn.send(("started", step, None))  # the deadline counts from here
        try:
            checkpoint = Checkpoint(f"{backend.url}/{name}", _stored=(backend, name, manifest))
            metrics = numeric_metrics(fn(checkpoint))
        except BaseException as e:
            conn.send(("err", step, RemoteFailure.capture(e)))
            continue
        conn.send(("ok", step, metrics))
