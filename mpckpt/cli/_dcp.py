"""``mpckpt info`` and ``mpckpt verify`` of a plain torch.distributed.checkpoint (DCP) folder.

A DCP folder (``.metadata`` and ``.distcp`` files, written by ``dcp.save(checkpoint_id=...)``)
is one state with no steps: ``info`` lists its tensors (whole shape, dtype, bytes, the files
holding their chunks) and the keys of its other values (stored ``torch.save``'d; named, not
read), from the metadata alone; ``verify`` reads every item and checks what can be checked.
DCP stores no checksums, and both commands say so. The metadata is read by the restricted
unpickler of ``format.dcp_metadata``: a folder that asks for any other class is refused,
naming the file and the class (status 1), and nothing of it runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from mpckpt._futures import size_text
from mpckpt.cli._common import BadArguments, say, say_json
from mpckpt.format.dcp_metadata import METADATA_NAME

NO_CHECKSUMS = "DCP stores no checksums"


def _folder(backend: Any) -> Any:
    from mpckpt._read.dcp_folder import DcpFolder  # torch: only a DCP folder needs it

    return DcpFolder(backend)


def _no_step(args: argparse.Namespace, command: str) -> None:
    step = getattr(args, "step", None)
    if step is not None:
        raise BadArguments(f"{args.root} is a torch.distributed.checkpoint folder: one state, no steps; "
                           f"run mpckpt {command} {args.root} without a step")


def info(backend: Any, args: argparse.Namespace) -> int:
    _no_step(args, "info")
    folder = _folder(backend)
    # the fields of info.py's TensorInfo and ValueInfo, so that --json reads the same
    tensors = [{"name": e.key, "dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape),
                "bytes": e.nbytes, "shards": sorted({item.file for item in e.items}), "shares": None}
               for e in folder.entries if e.dtype is not None]
    values = [{"name": e.key, "type": "torch.save",
               "value": f"<torch.save'd value of {e.items[0].length} bytes, not read>"}
              for e in folder.entries if e.dtype is None]
    files = sorted({item.file for e in folder.entries for item in e.items})
    stored = sum(t["bytes"] for t in tensors)
    version = getattr(folder.metadata, "version", None)
    if args.json:
        say_json({"step": None, "kind": "dcp", "dcp_version": version, "tensor_bytes": stored,
                  "tensors": tensors, "values": values,
                  "files": [METADATA_NAME, *files]})
        return 0
    say(f"{backend.url}: a torch.distributed.checkpoint folder (DCP {version or 'version unknown'}), "
        f"{len(files)} data files; {NO_CHECKSUMS} (mpckpt verify reads and checks every item)")
    say(f"tensors: {len(tensors)} ({size_text(stored)})")
    if tensors:
        rows = [("NAME", "DTYPE", "SHAPE", "BYTES", "FILES")]
        rows += [(t["name"], t["dtype"], str(t["shape"]), str(t["bytes"]), ", ".join(t["shards"])) for t in tensors]
        widths = [min(60, max(len(r[i]) for r in rows)) for i in range(4)]
        for r in rows:
            say("  " + "  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].ljust(widths[2]),
                                  r[3].rjust(widths[3]), r[4]]))
    say(f"values: {len(values)}")
    for v in values:
        say(f"  {v['name']} = {v['value']}")
    return 0


def verify(backend: Any, args: argparse.Namespace) -> int:
    _no_step(args, "verify")
    folder = _folder(backend)
    count = folder.verify()
    files = folder.files()
    say(f"{backend.url}: ok ({count} items in {len(files)} files, {size_text(sum(files.values()))}: every item "
        f"within its file, decoded, of the dtype and shape the metadata gives, the chunks covering every tensor "
        f"once; {NO_CHECKSUMS}, so a change inside an item that still decodes cannot be found)")
    return 0
