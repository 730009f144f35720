"""The shape the code keeps: no module in ``mpckpt/`` over 500 lines, the ``Checkpointer`` class
a facade of at most 250, and every module saying what it owns in a docstring at its top.

Read from the source with ``ast`` (nothing is imported), so it holds for every module, also those
a test run never imports.
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mpckpt"
MAX_MODULE_LINES = 500
MAX_FACADE_LINES = 250


def modules() -> list[pathlib.Path]:
    found = sorted(PACKAGE.rglob("*.py"))
    assert len(found) > 50, found  # the package is there: this test cannot pass on an empty glob
    return found


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split each by what it owns): {long}"


def test_the_checkpointer_class_is_a_thin_facade():
    tree = ast.parse((PACKAGE / "checkpointer.py").read_text())
    (facade,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Checkpointer"]
    assert facade.end_lineno is not None
    lines = facade.end_lineno - facade.lineno + 1
    assert lines <= MAX_FACADE_LINES, (f"the Checkpointer class is {lines} lines; it checks arguments and "
                                       f"delegates (at most {MAX_FACADE_LINES}): move the work behind it")


def test_every_module_says_what_it_owns():
    silent = [str(p.relative_to(PACKAGE.parent)) for p in modules()
              if not (ast.get_docstring(ast.parse(p.read_text())) or "").strip()]
    assert not silent, f"modules without a docstring at the top: {silent}"
