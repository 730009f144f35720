"""The on-storage format: safetensors shard headers and the manifest (FORMAT_VERSION).

Nothing here imports torch: uploader processes and readers without torch use it too.
"""

from mpckpt.format.manifest import FORMAT_VERSION, FileEntry, Manifest

__all__ = ["FORMAT_VERSION", "FileEntry", "Manifest"]
