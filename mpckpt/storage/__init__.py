"""Storage backends and the registry that picks one from a URL.

* a plain path or ``file://`` -> ``LocalBackend`` (direct writes, fsync, atomic rename; its
  one storage option is ``direct_io``);
* ``az://`` / ``abfs://`` / ``abfss://`` -> ``AzureBlobBackend`` (needs ``mpckpt[azure]``);
* any other scheme fsspec knows (``memory://``, ``s3://``, ``gs://`` ...) -> ``FsspecBackend``.

Optional backends are imported only when their scheme is used, with an install hint when
their package is missing. ``register_backend(scheme, "module:callable")`` adds a backend of
your own; the spec carries the import path, so uploader processes build it too, whatever
their start method.
"""

from __future__ import annotations

import os
from typing import Any

from mpckpt.errors import ConfigError
from mpckpt.storage.base import MANIFEST_NAME, Backend, BackendSpec, check_relpath

__all__ = ["MANIFEST_NAME", "Backend", "BackendSpec", "check_relpath", "open_backend", "register_backend",
           "spec_for_url"]

_AZURE_SCHEMES = ("az", "abfs", "abfss")
_REGISTERED: dict[str, str] = {}


def register_backend(scheme: str, factory: str) -> None:
    """Serve ``scheme://`` URLs with ``factory`` ("package.module:callable", called with a spec)."""
    if ":" not in factory:
        raise ConfigError(f"register_backend({scheme!r}, {factory!r}): the factory must be 'module:callable'")
    _REGISTERED[scheme.lower()] = factory


def spec_for_url(url: str | os.PathLike[str], options: dict[str, Any] | None = None, *,
                 direct_io: bool | None = None) -> BackendSpec:
    """Split a root URL into the backend spec that serves it.

    ``direct_io`` (``Config.direct_io``) applies to local roots only: it becomes their storage
    option of that name unless ``options`` set it already (the more specific setting wins);
    other schemes ignore it. The spec carries it into the uploader processes.
    """
    if not isinstance(url, (str, os.PathLike)):
        raise ConfigError(f"checkpoint root must be a path or URL string, got {type(url).__name__}")
    url = os.fspath(url)
    if not url:
        raise ConfigError("checkpoint root is empty; pass a folder path or a URL such as s3://bucket/run")
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if sep and scheme in _REGISTERED:
        return BackendSpec(scheme, url, dict(options or {}), factory=_REGISTERED[scheme])
    if sep and scheme != "file":
        return BackendSpec(scheme, url, dict(options or {}))
    local = dict(options or {})
    if direct_io is not None:
        local.setdefault("direct_io", direct_io)
    return BackendSpec("file", os.path.abspath(rest if sep else url), local)


def open_backend(spec: BackendSpec) -> Backend:
    """Build the backend a spec describes (in the training process or in an uploader)."""
    if spec.factory is not None:
        import importlib

        module, _, attr = spec.factory.partition(":")
        try:
            factory: Any = importlib.import_module(module)
            for part in attr.split("."):
                factory = getattr(factory, part)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"{spec.scheme}:// backend {spec.factory!r} cannot be imported: {e}") from e
        return factory(spec)  # type: ignore[no-any-return]
    if spec.scheme == "file":
        from mpckpt.storage.local import LocalBackend

        return LocalBackend(spec.root, spec.options)
    if spec.scheme in _AZURE_SCHEMES:
        try:
            from mpckpt.storage.azure import AzureBlobBackend
        except ImportError as e:
            raise ConfigError(
                f"{spec.root}: install mpckpt[azure] (azure-storage-blob) for {spec.scheme}:// URLs"
            ) from e
        return AzureBlobBackend.from_spec(spec)
    try:
        from mpckpt.storage.fsspec_backend import FsspecBackend
    except ImportError as e:
        raise ConfigError(f"{spec.root}: install fsspec for {spec.scheme}:// URLs") from e
    return FsspecBackend.from_spec(spec)
