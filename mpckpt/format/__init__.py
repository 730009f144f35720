"""The on-storage format: safetensors shard headers and the manifest (FORMAT_VERSION).

Nothing here imports torch at import time: uploader processes and readers without torch use it
too (``dcp_metadata``, the reader of DCP's ``.metadata``, imports torch inside its functions).
"""

from mpckpt.format.manifest import FORMAT_VERSION, FileEntry, Manifest

__all__ = ["FORMAT_VERSION", "FileEntry", "Manifest"]
