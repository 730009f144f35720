"""What every command of ``mpckpt`` shares: escaped output, opening a root, finding a step,
the exit status, and how checkpoints are described (time, size, dotted state paths, JSON).

A root named wrongly is never an empty listing: a local folder that does not exist is an
error saying so (status 1), and one that holds no checkpoint is said to on stderr by every
command that reads it, with the checkpoint roots found below it (``_roots``): ``scan_root``
says it (``ls``, ``stats``, ``verify``), and ``committed_step``, ``chosen_step`` and
``require_checkpoints`` make it the ``BadArguments`` of a command that names a step.

INVARIANT: everything a command prints goes through ``say`` or ``complain`` (the library's
log records too, through ``PrintableLog``), which escape control characters: file names,
metrics and error messages quoting them come from storage, and a hostile manifest must not
drive the terminal (``--json`` output is ASCII-escaped JSON, so it passes unchanged). A
command returns 0 or 1; ``exit_status`` turns an ``MpckptError`` into a one-line message and
1, or 2 for ``BadArguments`` (a step that is not there, a target that exists ...), never a
traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from mpckpt.catalog import scan
from mpckpt.cli._roots import missing, no_checkpoint
from mpckpt.errors import ConfigError, CorruptCheckpointError, MpckptError
from mpckpt.format.manifest import Manifest
from mpckpt.storage import open_backend, spec_for_url


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file or folder (a folder: the names in it) to disk, as exports do before and after a rename."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def printable(text: object) -> str:
    """``text`` with control characters (C0, DEL, C1) shown as escapes, never sent raw."""
    return "".join(c if c.isprintable() or c == " " else ascii(c)[1:-1] for c in str(text))


def say(text: object) -> None:
    print(printable(text))


def complain(text: object) -> None:
    print(printable(text), file=sys.stderr)


class PrintableLog(logging.Handler):
    """The library's log records, escaped like everything else this command prints."""

    def emit(self, record: logging.LogRecord) -> None:
        complain(f"mpckpt: {record.getMessage()}")


def route_library_log() -> None:
    """Send the library's errors through ``complain``; the commands report warnings themselves."""
    logger = logging.getLogger("mpckpt")
    if not logger.handlers:  # the command reports what the scan would warn about itself
        logger.addHandler(PrintableLog())
        logger.setLevel(logging.ERROR)
        logger.propagate = False


class BadArguments(ConfigError):
    """The command line names something that is not there or cannot be done: exit status 2."""


def exit_status(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run ``command``: its status, or 1 (2 for ``BadArguments``) with the error on stderr when
    it raises ``MpckptError``."""
    try:
        return int(command(args))
    except BrokenPipeError:  # `mpckpt ls --json | head`: the reader is gone; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
        return 1
    except BadArguments as e:
        complain(f"mpckpt: {e}")
        return 2
    except MpckptError as e:
        complain(f"mpckpt: {e}")
        return 1


def backend_for(root: str, options: str | None) -> Any:
    """The backend of ``root``; ``options`` is the ``--storage-options`` JSON text, if any."""
    try:
        parsed = json.loads(options) if options else None
    except ValueError as e:
        raise BadArguments(f"--storage-options is not a JSON object ({e})") from e
    spec = spec_for_url(root, parsed)
    if spec.scheme == "file" and not os.path.isdir(spec.root):
        if os.path.lexists(spec.root):
            what = "a file, not a folder" if os.path.isfile(spec.root) else "not a folder"
            raise ConfigError(f"{spec.root} is {what}; give the folder a Checkpointer wrote to")
        raise ConfigError(missing(spec.root))
    return open_backend(spec)


def scan_root(backend: Any, *, clean: bool = False) -> tuple[dict[int, Manifest], dict[int, Exception]]:
    """The committed checkpoints of ``backend`` by step, and the steps whose folder is damaged;
    when there is neither, says so on stderr (``no_checkpoint_text``)."""
    committed, problems = scan_quietly(backend, clean=clean)
    if not committed and not problems:
        complain(f"mpckpt: {no_checkpoint_text(backend)}")
    return committed, problems


def scan_quietly(backend: Any, *, clean: bool = False) -> tuple[dict[int, Manifest], dict[int, Exception]]:
    """``scan_root`` that says nothing of a root with no checkpoint."""
    problems: dict[int, Exception] = {}
    return scan(backend, clean=clean, problems=problems), problems


def no_checkpoint_text(backend: Any) -> str:
    """What to say of a root with no checkpoint: for a local folder, the roots below it too."""
    url = str(getattr(backend, "url", ""))
    if os.path.isabs(url) and os.path.isdir(url):
        return no_checkpoint(url)
    return f"no checkpoint in {url}; give the folder a Checkpointer was given (it holds step_* folders)"


def require_checkpoints(backend: Any, committed: Mapping[int, Manifest], problems: Mapping[int, Exception]) -> None:
    """``BadArguments`` (status 2) saying there is no checkpoint, and where roots are, if so."""
    if not committed and not problems:
        raise BadArguments(no_checkpoint_text(backend))


def chosen_step(backend: Any, step: int | None) -> Manifest:
    """``committed_step``, where ``None`` is the newest checkpoint (damaged or not: what
    ``mpckpt.load`` reads; a damaged one is status 1 with the reason)."""
    if step is not None:
        return committed_step(backend, step)
    committed, problems = scan_quietly(backend)
    require_checkpoints(backend, committed, problems)
    return _manifest_of(backend, max([*committed, *problems]), committed, problems)


def committed_step(backend: Any, step: int) -> Manifest:
    """The manifest of committed ``step``: ``BadArguments`` naming the steps there are when it is
    not there, the reason when its folder is damaged (status 1)."""
    committed, problems = scan_quietly(backend)
    require_checkpoints(backend, committed, problems)
    return _manifest_of(backend, step, committed, problems)


def _manifest_of(backend: Any, step: int, committed: Mapping[int, Manifest],
                 problems: Mapping[int, Exception]) -> Manifest:
    if step in problems:
        problem = problems[step]
        raise problem if isinstance(problem, MpckptError) else CorruptCheckpointError(f"step {step}: {problem}")
    if step not in committed:
        raise BadArguments(f"no checkpoint of step {step} in {backend.url}; {steps_there(committed)}")
    return committed[step]


def steps_there(committed: Iterable[int]) -> str:
    steps = sorted(committed)
    if not steps:
        return "there is none"
    shown = ", ".join(map(str, steps[-20:]))
    return f"committed steps: {shown}" if len(steps) <= 20 else f"the newest 20 of {len(steps)} steps: {shown}"


def iso_time(unix: float) -> str:
    """``unix`` as ISO 8601 in UTC, to the second (what ``--json`` calls ``time``)."""
    try:
        return datetime.datetime.fromtimestamp(unix, tz=datetime.timezone.utc).isoformat(timespec="seconds")
    except (OverflowError, OSError, ValueError):  # a manifest may claim any number
        return "?"


def own_bytes(manifest: Manifest) -> int:
    """Bytes in the checkpoint's own folder (shared files, and files of an earlier one, excluded)."""
    return sum(e.size for e in manifest.files.values() if e.ref is None and e.shared is None)


def shared_bytes(manifest: Manifest) -> int:
    """Bytes of the files in ``shared/`` the checkpoint lists (other checkpoints may list them too)."""
    return sum(e.size for e in manifest.files.values() if e.shared is not None)


def total_bytes(manifest: Manifest) -> int:
    """Bytes of every file the checkpoint lists: what loading it reads."""
    return sum(e.size for e in manifest.files.values())


def dotted(parent: str, key: object) -> str:
    """The dotted path of ``key`` under ``parent``: the names ``save`` gives tensors (``model.0.weight``)."""
    return f"{parent}.{key}" if parent else str(key)


def children(node: Any) -> list[tuple[str, Any]] | None:
    """The named parts of a container of a loaded state, in order; None for anything else.

    The names are those ``save`` gives: dict keys, list and tuple indexes, the field names of
    namedtuples and dataclass instances. Sets have no order to name their items by: a value.
    """
    if isinstance(node, Mapping):
        return [(str(k), v) for k, v in node.items()]
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return [(str(k), v) for k, v in zip(node._fields, node, strict=False)]
    if isinstance(node, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(node)]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    return None


def state_items(node: Any, path: str = "", *, whole: Callable[[Any], bool] | None = None) -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every tensor and every other value of a loaded state, in state
    order: what is not a container, an empty container, or a container ``whole`` keeps whole."""
    parts = children(node)
    if not parts or (whole is not None and whole(node)):
        yield path, node
        return
    for key, child in parts:
        yield from state_items(child, dotted(path, key), whole=whole)


def json_value(value: Any) -> Any:
    """``value`` as strict JSON: non-finite floats become their repr (as the manifest writes them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    return value


def say_json(document: Any) -> None:
    """``document`` as indented JSON; ASCII-escaped, so no line of it holds a control character."""
    for line in json.dumps(json_value(document), indent=1, allow_nan=False).splitlines():
        say(line)


def shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


