"""Integrations build on the core's public seams only (``mpckpt.extension`` and the public API).

Read from the source with ``ast`` (nothing imported): no module under ``mpckpt/integrations``
imports ``mpckpt._*`` or a private name of a core module, and none touches an attribute with a
leading underscore of an object that is not its own (``self``/``cls``). Two exceptions, neither
mpckpt's: ``sys._getframe`` (the standard library's) and ``super()._x`` (a framework's own
method that an integration's subclass overrides).
"""

from __future__ import annotations

import ast
from pathlib import Path

import mpckpt.extension

INTEGRATIONS = Path(__file__).resolve().parents[2] / "mpckpt" / "integrations"


def _private(module: str) -> bool:
    """A core module that is private (``mpckpt._x``...); the integrations' own helpers are theirs."""
    parts = module.split(".")
    return parts[0] == "mpckpt" and parts[1:2] != ["integrations"] and any(p.startswith("_") for p in parts[1:])


def _reaches(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        where = f"{path.name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mpckpt"):
            if _private(node.module):
                found.append(f"{where} from {node.module} import ...")
            found += [f"{where} from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not node.module.startswith("mpckpt.integrations._")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls", "sys"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            found.append(f"{where} {ast.unparse(node)}")
    return found


def test_no_integration_reaches_into_the_core():
    reaches = [r for path in sorted(INTEGRATIONS.glob("*.py")) for r in _reaches(path)]
    assert not reaches, "use mpckpt.extension (or add the seam there):\n" + "\n".join(reaches)


def test_heal_takes_the_checkpointer_through_the_seams():
    """``mpckpt.heal`` is part of the core (its launcher's helpers are its own) but lets go of and
    reopens a Checkpointer through ``mpckpt.extension``, never its private attributes."""
    healing = INTEGRATIONS.parent / "healing.py"
    attributes = [r for r in _reaches(healing) if " from " not in r and " import " not in r]
    assert not attributes, "use mpckpt.extension (or add the seam there):\n" + "\n".join(attributes)


def test_the_checker_sees_a_reach(tmp_path: Path):
    sample = tmp_path / "sample.py"
    sample.write_text("from mpckpt._read.sources import Source\nfrom mpckpt.checkpointer import _check_step\n"
                      "import mpckpt._threads\nx = ckpt._rt.group\ny = self.ckpt._writer()\nz = self._mine\n")
    assert [r.split(" ", 1)[1] for r in _reaches(sample)] == [
        "from mpckpt._read.sources import ...", "from mpckpt.checkpointer import _check_step",
        "import mpckpt._threads", "ckpt._rt", "self.ckpt._writer"]


def test_every_seam_is_public_and_documented():
    for name in mpckpt.extension.__all__:
        assert not name.startswith("_") and hasattr(mpckpt.extension, name), name
        assert name in (mpckpt.extension.__doc__ or ""), f"{name} is not described in mpckpt.extension's docstring"
