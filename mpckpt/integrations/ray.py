"""Ray Train: ``report(ckpt, step, state, metrics)`` in place of ``ray.train.report``.

This module owns everything mpckpt does inside a Ray Train (v2) train function, and is the
only place in mpckpt that imports ``ray`` (through ``require``, so a missing Ray is an
ImportError saying ``pip install 'mpckpt[ray]'``):

- ``experiment_root()`` / ``open_checkpointer()``: where the run's Checkpointer lives, a folder
  (``mpckpt/`` by default) inside Ray's experiment folder (``RunConfig(storage_path=, name=)``),
  so that Ray Train manages its checkpoints (it refuses checkpoints outside that folder).
  Every worker opens the same root: inside ``TorchTrainer`` the workers are ranks of one
  torch.distributed group, so the Checkpointer is one multi-rank job (collective open).
- ``report(ckpt, step, state, metrics)``: ``ckpt.save`` (returns after the local snapshot),
  then ``ray.train.report(..., checkpoint_upload_mode=ASYNC, checkpoint_upload_fn=...)`` whose
  upload function, run in Ray's upload thread, only waits for mpckpt's commit and hands Ray the
  committed folder ``<root>/step_N``. Ray registers checkpoints in report order, and mpckpt
  commits in save order, so ``Result.checkpoint``, ``Result.best_checkpoints`` and
  ``ray.train.get_checkpoint()`` only ever name committed mpckpt checkpoints.
- ``restore(ckpt, state)``: after Ray restarted the workers (``FailureConfig``), first reports
  to Ray the commits it never heard of (the worker died between the commit and the report),
  then restores the latest commit into ``state``.

Retention belongs to Ray: ``CheckpointConfig(num_to_keep=, checkpoint_score_attribute=)``
decides, and Ray deletes the folder. The Checkpointer must therefore keep everything
(``keep=``/``keep_last=`` are refused): two deleters would race, and Ray's controller fails
when a folder it deletes is already gone. Ray never deletes what mpckpt still needs: it
only knows committed checkpoints, never deletes its latest one (which is never newer than
mpckpt's latest), and files shared between checkpoints live in ``<root>/shared``, never in a
step folder. Before each save, ``report`` drops from the Checkpointer's listing the steps
whose folders Ray deleted, so ``ckpt.steps()`` and ``ckpt.best()`` agree with Ray.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

from mpckpt.checkpointer import Checkpointer
from mpckpt.config import BudgetPolicy, UploadMode
from mpckpt.errors import ConfigError
from mpckpt.format.names import checkpoint_name, step_of
from mpckpt.integrations import require

__all__ = ["experiment_root", "open_checkpointer", "report", "restore"]

DEFAULT_SUBDIR = "mpckpt"


@functools.lru_cache(maxsize=1)
def _ray_train() -> Any:
    train = require("ray.train", "ray")
    import inspect

    wanted = {"checkpoint_upload_mode", "checkpoint_upload_fn", "checkpoint_dir_name"}
    missing = wanted - set(inspect.signature(train.report).parameters)
    if missing:
        version = getattr(require("ray", "ray"), "__version__", "?")
        raise ImportError("mpckpt.integrations.ray needs Ray Train v2's ray.train.report(..., "
                          f"{', '.join(sorted(wanted))}) (Ray 2.60 has them; this Ray {version} lacks "
                          f"{', '.join(sorted(missing))}; with RAY_TRAIN_V2_ENABLED=0 set it back to 1)")
    return train


def _storage() -> Any:
    """Ray Train's StorageContext of the running train function."""
    train = _ray_train()
    try:
        return train.get_context().get_storage()
    except Exception as e:  # outside a train function Ray raises its own errors
        raise ConfigError("mpckpt.integrations.ray works inside a Ray Train train function "
                          f"(TorchTrainer(train_loop_per_worker=...)): {e}") from e


def _url_of(fs: Any, path: str) -> str:
    """``path`` on pyarrow filesystem ``fs`` as a root mpckpt opens."""
    kind = getattr(fs, "type_name", "local")
    if kind == "local":
        return path
    if kind == "s3":
        return f"s3://{path}"
    if kind == "gcs":
        return f"gs://{path}"
    raise ConfigError(f"Ray's storage filesystem {kind!r} has no mpckpt backend here; use a local or shared "
                      "storage_path, or s3://")


def experiment_root(subdir: str = DEFAULT_SUBDIR) -> str:
    """The root (path or URL) of this run's Checkpointer: ``<Ray experiment folder>/<subdir>``."""
    if not subdir or subdir.startswith("/") or ".." in subdir.split("/"):
        raise ConfigError(f"subdir={subdir!r} must be a relative folder name inside Ray's experiment folder")
    storage = _storage()
    return _url_of(storage.storage_filesystem, f"{storage.experiment_fs_path.rstrip('/')}/{subdir}")


def open_checkpointer(subdir: str = DEFAULT_SUBDIR, **options: Any) -> Checkpointer:
    """A ``Checkpointer`` at ``experiment_root(subdir)`` (every worker calls it: a collective open)."""
    return Checkpointer(experiment_root(subdir), **options)


def _checked_dir_prefix(ckpt: Checkpointer, storage: Any) -> str:
    """The checkpoint folder prefix of ``ckpt`` relative to Ray's experiment folder; refuses what Ray cannot manage."""
    if ckpt.read_only:
        raise ConfigError("report() saves: give it the Checkpointer that writes, not a read_only one")
    config = ckpt.config
    if config.keep is not None or config.keep_last is not None:
        raise ConfigError("with Ray Train, retention belongs to Ray: drop keep=/keep_last= from the Checkpointer "
                          "and set ray.train.CheckpointConfig(num_to_keep=..., checkpoint_score_attribute=...)")
    if config.policy is BudgetPolicy.COALESCE:
        raise ConfigError("policy='coalesce' may drop a checkpoint after Ray was told about it; with Ray Train "
                          "use policy='block' (default) or 'skip'")
    experiment = storage.experiment_fs_path.rstrip("/")
    url = ckpt.url.rstrip("/")
    if "://" in url:
        scheme, _, rest = url.partition("://")
        url = rest if scheme in ("file", "s3", "gs", "gcs") else url
    if getattr(storage.storage_filesystem, "type_name", "local") == "local":
        url, experiment = os.path.realpath(url), os.path.realpath(experiment)
    if not url.startswith(experiment + "/"):
        raise ConfigError(f"the Checkpointer's root {ckpt.url} is outside Ray Train's experiment folder "
                          f"{storage.experiment_fs_path}, so Ray could not manage its checkpoints; open it at "
                          "mpckpt.integrations.ray.experiment_root() (or open_checkpointer())")
    return url[len(experiment) + 1:]


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """The metrics mpckpt records in the manifest: plain numbers (Ray gets all of them)."""
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        if hasattr(value, "item") and callable(value.item):
            try:
                value = value.item()
            except (TypeError, ValueError):
                continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[str(key)] = value
    return out


def _forget_deleted(ckpt: Checkpointer) -> list[int]:
    """Drop from ``ckpt``'s listing the committed steps whose folder Ray's retention deleted."""
    return ckpt.forget_deleted()


def _await_commit(future: Any, wait_s: float | None, checkpoint: Any, checkpoint_dir_name: str) -> Any:
    """Ray's ``checkpoint_upload_fn``: wait for mpckpt's commit (the upload), return the committed folder."""
    result = future.result(wait_s)
    if result.name is None:  # cannot happen with block/skip once the snapshot was taken
        raise RuntimeError(f"mpckpt did not commit step {future.step} ({future.stats.status}); "
                           f"nothing to hand to Ray for {checkpoint_dir_name}")
    return checkpoint


def report(ckpt: Checkpointer, step: int, state: Any, metrics: Mapping[str, Any] | None = None, *,
           mode: UploadMode | str = UploadMode.ASYNC, wait_s: float | None = None, force: bool = False) -> Any:
    """Save ``state`` as checkpoint ``step`` and report it and ``metrics`` to Ray Train; every worker calls it.

    Returns once the state is copied into shared memory (``mode=ASYNC``, the default) or
    committed (``SYNC``), with mpckpt's ``SaveFuture`` (``None`` when ``ckpt``'s trigger said
    the step is not due: then only the metrics are reported). Ray learns of the checkpoint
    when mpckpt has committed it, in report order, as ``Checkpoint(<root>/step_N)``;
    ``mpckpt.load(checkpoint.path)`` reads it. A failed commit fails the train function (Ray's
    ``FailureConfig`` then restarts the workers). ``wait_s``: how long Ray's upload thread
    waits for one commit (default: no limit; mpckpt's own timeouts still apply).
    """
    train = _ray_train()
    from ray.train import CheckpointUploadMode

    storage = _storage()
    prefix = _checked_dir_prefix(ckpt, storage)
    metrics = dict(metrics or {})
    try:
        mode = mode if isinstance(mode, UploadMode) else UploadMode(str(mode).lower())
    except ValueError:
        raise ConfigError(f"mode={mode!r} is not 'async' or 'sync'") from None
    if mode is UploadMode.NO_UPLOAD:
        raise ConfigError("report() saves state; use mode='async' or 'sync'")
    _forget_deleted(ckpt)
    future = ckpt.save(step, state, metrics=_numbers(metrics), mode=mode, force=force)
    if future is None or future.stats.status == "skipped":
        train.report(metrics)
        return future
    dir_name = f"{prefix}/{checkpoint_name(future.step)}"
    placeholder = train.Checkpoint(path=storage.build_checkpoint_path_from_name(dir_name),
                                   filesystem=storage.storage_filesystem)
    train.report(metrics, checkpoint=placeholder, checkpoint_dir_name=dir_name,
                 checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                 delete_local_checkpoint_after_upload=False,
                 checkpoint_upload_fn=functools.partial(_await_commit, future, wait_s))
    return future


def _step_of_ray_checkpoint(checkpoint: Any) -> int | None:
    if checkpoint is None:
        return None
    return step_of(str(checkpoint.path).rstrip("/").rpartition("/")[2])


def restore(ckpt: Checkpointer, state: Any, **options: Any) -> int | None:
    """Load the latest commit into ``state`` (``ckpt.restore``) after telling Ray about commits it missed.

    Every worker calls it, once, before training. A worker that died after mpckpt committed a
    step but before Ray registered it leaves a commit Ray does not know: it is reported now
    (``NO_UPLOAD``, with the metrics its manifest holds), so Ray's retention and
    ``Result.checkpoint`` cover it. Returns the restored step, or None on a fresh start.
    """
    train = _ray_train()
    from ray.train import CheckpointUploadMode

    storage = _storage()
    prefix = _checked_dir_prefix(ckpt, storage)
    known = _step_of_ray_checkpoint(train.get_checkpoint())
    for step in ckpt.steps():
        if known is not None and step <= known:
            continue
        metrics = ckpt.checkpoint(step).metrics
        dir_name = f"{prefix}/{checkpoint_name(step)}"
        train.report(metrics, checkpoint=train.Checkpoint(path=storage.build_checkpoint_path_from_name(dir_name),
                                                          filesystem=storage.storage_filesystem),
                     checkpoint_dir_name=dir_name, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
    return ckpt.restore(state, **options)
