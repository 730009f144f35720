"""Guards the import graph of ``mpckpt``: no import circle, lazy imports included, and no layer
reaching up.

The graph is read from the source with ``ast``; no module is imported. Every ``import`` and
``from ... import`` counts wherever it stands: at module level, inside a function or method
(a lazy import still ties the two modules together), under ``if TYPE_CHECKING:``. Importing
``mpckpt.a.b`` also runs the ``__init__`` of ``mpckpt`` and ``mpckpt.a``; those implicit edges
are left out on purpose, since ``mpckpt/__init__.py`` re-exports the facade and counting them
would make the whole package one circle.

The direction, top to bottom (STYLE.md): the edges (integrations, CLI) -> the facade ->
``_runtime`` / ``_opening`` -> ``_peer`` -> ``_keep`` -> ``_save`` (a save's orchestration) ->
``_read`` / ``_stage`` / ``_upload`` / ``_commit`` -> ``_codec`` / ``_dist`` -> the bottom
(``format``, ``storage``, ``errors``, ``_system``, ``_ledger``...). ``LAYERS`` draws that
picture and every import is checked against it; ``RULES`` adds what must not meet inside
one layer.
"""

from __future__ import annotations

import ast
import textwrap
from collections import deque
from pathlib import Path
from typing import NamedTuple

PACKAGE_ROOT = Path(__file__).resolve().parents[2] / "mpckpt"

# The picture, lowest first: a module may import from its own layer and the ones below it
# (``test_every_import_follows_the_picture``, no exceptions). Each entry is a module and
# everything under it, except "mpckpt", which is the package's __init__ alone; the most
# specific entry places a module. RULES adds, one line each, what the picture allows but the
# design does not (parts of one layer that must not know each other).
LAYERS: list[tuple[str, ...]] = [
    ("mpckpt.errors", "mpckpt._dtypes", "mpckpt.per_rank", "mpckpt.format", "mpckpt.storage", "mpckpt.config",
     "mpckpt.options", "mpckpt.policies", "mpckpt._futures", "mpckpt._preemption", "mpckpt._progress", "mpckpt.loop", "mpckpt.rng",
     "mpckpt.data", "mpckpt._testing", "mpckpt._threads", "mpckpt.process_group", "mpckpt._system", "mpckpt._ledger",
     "mpckpt._generations", "mpckpt._supervisor", "mpckpt._links"),
    ("mpckpt._codec", "mpckpt._dist"),
    ("mpckpt._read", "mpckpt._stage", "mpckpt._upload", "mpckpt._commit", "mpckpt.catalog", "mpckpt.checkpoint"),
    ("mpckpt._save",),
    ("mpckpt._keep",),
    ("mpckpt._peer",),
    ("mpckpt._runtime", "mpckpt._opening", "mpckpt._view", "mpckpt._writer_lock"),
    ("mpckpt.checkpointer", "mpckpt", "mpckpt.extension", "mpckpt.healing"),
    ("mpckpt.integrations", "mpckpt.cli", "mpckpt.run", "mpckpt._spare"),
]

_PRIVATE_LAYERS = (
    "mpckpt._stage", "mpckpt._upload", "mpckpt._commit", "mpckpt._read", "mpckpt._codec", "mpckpt._dist",
    "mpckpt._runtime", "mpckpt._opening", "mpckpt._save",
)
_TOP = ("mpckpt.checkpointer", "mpckpt.catalog", "mpckpt.cli", "mpckpt.integrations")
_BOTTOM_WHY = "the bytes on storage and the error tree sit at the bottom; everything else builds on them"
_CODEC_WHY = "the codec turns values into tensors and back; the pipelines call it, never the other way"
_EDGE = ("mpckpt.integrations", "mpckpt.cli")
_SAVE_WHY = "the save side never needs the read side or the runtime that drives it"
_READ_WHY = "the read side serves the facade and the runtime; it never drives them, nor the uploaders"


class Rule(NamedTuple):
    layer: str  # a module name prefix: the module itself and everything under it
    forbidden: tuple[str, ...]  # prefixes the layer must not import
    why: str
    exempt: tuple[str, ...] = ()  # prefixes inside ``layer`` the rule does not apply to


RULES: list[Rule] = [
    Rule("mpckpt.format", _PRIVATE_LAYERS + _TOP, _BOTTOM_WHY),
    Rule("mpckpt.storage", _PRIVATE_LAYERS + _TOP, _BOTTOM_WHY),
    Rule("mpckpt.errors", _PRIVATE_LAYERS + _TOP, _BOTTOM_WHY),
    Rule("mpckpt._dtypes", _PRIVATE_LAYERS + _TOP, _BOTTOM_WHY),
    Rule("mpckpt._system", _PRIVATE_LAYERS + _TOP + ("mpckpt._keep", "mpckpt._peer", "mpckpt.storage", "mpckpt.format"),
         "shared memory and processes are what both sides stand on: the trainer's stages and the uploaders"),
    Rule("mpckpt._read", ("mpckpt._stage",), "the read side decodes with _codec, beside its encoder; it never "
         "needs the save's stages"),
    Rule("mpckpt._upload", ("mpckpt._stage", "mpckpt._commit", "mpckpt._save"), "an uploader writes files; it "
         "knows nothing of how snapshots are staged (the segments it reads are _system's) or commit"),
    Rule("mpckpt._commit", ("mpckpt._upload", "mpckpt._stage", "mpckpt._save"), "the commit settles what the uploads did, through "
         "the ledger; it starts no upload and stages nothing"),
    Rule("mpckpt._codec", ("mpckpt._stage", "mpckpt._upload", "mpckpt._commit", "mpckpt._read", "mpckpt._runtime",
                           "mpckpt.checkpointer"), _CODEC_WHY),
    Rule("mpckpt", _EDGE, "integrations and the CLI are optional edges; the core never imports them", exempt=_EDGE),
    Rule("mpckpt._stage", ("mpckpt._read", "mpckpt._runtime", "mpckpt._opening", "mpckpt.checkpointer"), _SAVE_WHY),
    Rule("mpckpt._stage", ("mpckpt._upload", "mpckpt._commit", "mpckpt._save"), "a stage copies and lays out; the "
         "save's orchestration (_save) drives it and the uploads and the records"),
    Rule("mpckpt._ledger", _PRIVATE_LAYERS + _TOP + ("mpckpt._save", "mpckpt._keep", "mpckpt._peer"),
         "the record book sits below every stage that writes in it"),
    Rule("mpckpt._upload", ("mpckpt._read", "mpckpt._runtime", "mpckpt._opening", "mpckpt.checkpointer"), _SAVE_WHY),
    Rule("mpckpt._read", ("mpckpt._runtime", "mpckpt._opening", "mpckpt.checkpointer", "mpckpt._upload"), _READ_WHY),
    Rule("mpckpt._read", ("mpckpt._keep",), "the read side knows a memory source only as a Source the view hands it"),
    Rule("mpckpt._stage", ("mpckpt._keep",), "a save hands its slab to whatever keeper the runtime wired in"),
    Rule("mpckpt._keep", ("mpckpt._runtime", "mpckpt._opening", "mpckpt.checkpointer", "mpckpt._upload",
                          "mpckpt._commit"), "the recovery tier keeps slabs and reads them; the runtime wires it in"),
    Rule("mpckpt._keep", ("mpckpt._peer",), "a node's own memory knows the copies on other nodes only as the hook "
         "the runtime wired in"),
    Rule("mpckpt._peer", ("mpckpt._runtime", "mpckpt._opening", "mpckpt.checkpointer", "mpckpt._upload",
                          "mpckpt._commit", "mpckpt._read"), "the copies on other nodes build on the node's own memory; "
         "the runtime wires them in"),
]


class Site(NamedTuple):
    """Where one import statement stands."""

    path: str  # relative to the folder that holds the package
    line: int
    kind: str  # "top", "lazy" (inside a function) or "typing" (under TYPE_CHECKING)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}" + ("" if self.kind == "top" else f" ({self.kind})")


Graph = dict[str, dict[str, list[Site]]]  # importer -> imported -> the statements


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package by dotted name; a package is its ``__init__`` (or its folder)."""
    found: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((package, *parts))] = path
        for depth in range(len(parts) - 1):  # folders without __init__ are namespace packages
            found.setdefault(".".join((package, *parts[: depth + 1])), path.parents[len(parts) - 2 - depth])
    found.setdefault(package, root)
    return found


class _ImportCollector(ast.NodeVisitor):
    """Every import statement in one file with its line and whether it is lazy or typing-only."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.Import | ast.ImportFrom, str]] = []
        self._kind = ["top"]

    def _nested(self, nodes: list[ast.stmt], kind: str) -> None:
        self._kind.append(kind if self._kind[-1] == "top" else self._kind[-1])  # the outer kind wins
        for node in nodes:
            self.visit(node)
        self._kind.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._nested(node.body, "lazy")

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._nested(node.body, "lazy")

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            self._nested(node.body, "typing")
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append((node, self._kind[-1]))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append((node, self._kind[-1]))


def _targets(node: ast.Import | ast.ImportFrom, importer: str, is_package: bool, known: set[str]) -> list[str]:
    """The dotted names one statement imports, before mapping them to known modules."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: resolve against the importer's own package
        anchor = importer.split(".")
        if not is_package:
            anchor = anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    names = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}" if base else alias.name
        names.append(candidate if candidate in known else base)
    return names


def _resolve(name: str, known: set[str]) -> str:
    """The module a dotted name lands in: itself if it is one, else the longest known prefix."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def build_graph(root: Path, package: str) -> Graph:
    """The package's import graph, read from the source under ``root`` (the package folder)."""
    modules = _modules(root, package)
    known = set(modules)
    graph: Graph = {name: {} for name in modules}
    for importer, path in modules.items():
        if path.is_dir():
            continue
        collector = _ImportCollector()
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        site_path = path.relative_to(root.parent).as_posix()
        for node, kind in collector.found:
            for raw in _targets(node, importer, path.name == "__init__.py", known):
                if not _under(raw, package):
                    continue
                target = _resolve(raw, known)
                if not target or target == importer:
                    continue
                sites = graph[importer].setdefault(target, [])
                site = Site(site_path, node.lineno, kind)
                if site not in sites:  # one statement naming several things lands once
                    sites.append(site)
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's algorithm, iterative; the components come out sorted by name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return sorted(components)


def _path_back(graph: Graph, start: str, goal: str, within: set[str]) -> list[str]:
    """The shortest path start -> ... -> goal inside one component (breadth first)."""
    came_from: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            break
        for child in sorted(graph[node]):
            if child in within and child not in came_from:
                came_from[child] = node
                queue.append(child)
    path: list[str] = []
    step: str | None = goal
    while step is not None:
        path.append(step)
        step = came_from[step]
    return path[::-1]


def circles(graph: Graph) -> list[list[str]]:
    """For every edge inside a component, the shortest circle through it; each circle once."""
    found: dict[tuple[str, ...], list[str]] = {}
    for component in strongly_connected(graph):
        if len(component) < 2:
            continue
        members = set(component)
        for source in component:
            for target in sorted(graph[source]):
                if target not in members:
                    continue
                loop = [source, *_path_back(graph, target, source, members)]
                turn = loop.index(min(loop[:-1]))
                key = tuple(loop[turn:-1] + loop[:turn])
                found.setdefault(key, [*key, key[0]])
    return sorted(found.values(), key=lambda loop: (len(loop), loop))


def describe_circles(graph: Graph) -> str:
    lines = []
    for loop in circles(graph):
        lines.append(" -> ".join(loop))
        for source, target in zip(loop[:-1], loop[1:], strict=True):
            sites = ", ".join(str(site) for site in graph[source][target])
            lines.append(f"    {source} -> {target}: {sites}")
    return "\n".join(lines)


def violations(graph: Graph, rules: list[Rule]) -> list[str]:
    found = []
    for rule in rules:
        for importer in sorted(graph):
            if not _under(importer, rule.layer) or any(_under(importer, e) for e in rule.exempt):
                continue
            for target, sites in sorted(graph[importer].items()):
                for prefix in rule.forbidden:
                    if _under(target, prefix):
                        where = ", ".join(str(site) for site in sites)
                        found.append(f"{importer} -> {target} ({where}): {rule.layer} must not import {prefix}; "
                                     f"{rule.why}")
    return found


def test_no_import_circle() -> None:
    graph = build_graph(PACKAGE_ROOT, "mpckpt")
    assert len(graph) > 20, "the graph builder found almost no modules; is PACKAGE_ROOT right?"
    report = describe_circles(graph)
    assert not report, (
        "import circles in mpckpt (lazy and TYPE_CHECKING imports count); break one edge of each:\n" + report
    )


def parts_graph(graph: Graph) -> Graph:
    """The graph between mpckpt's first-level parts (``mpckpt._read``, ``mpckpt.catalog``...): an
    edge wherever a module of one imports a module of another."""
    def part(module: str) -> str:
        return ".".join(module.split(".")[:2])

    parts: Graph = {}
    for importer, targets in graph.items():
        for target, sites in targets.items():
            a, b = part(importer), part(target)
            if a != b and "mpckpt" not in (a, b):
                parts.setdefault(a, {}).setdefault(b, []).extend(sites)
                parts.setdefault(b, {})
    return parts


def test_no_circle_between_first_level_parts() -> None:
    report = describe_circles(parts_graph(build_graph(PACKAGE_ROOT, "mpckpt")))
    assert not report, "mpckpt's first-level parts import each other in a circle; move the piece to its layer:\n" + report


def test_layers_never_reach_up() -> None:
    graph = build_graph(PACKAGE_ROOT, "mpckpt")
    for rule in RULES:  # a rule that names no module has gone stale (a rename, a typo)
        assert any(_under(module, rule.layer) for module in graph), f"no module under {rule.layer}"
    found = violations(graph, RULES)
    assert not found, "imports that reach up a layer:\n" + "\n".join(found)


def _layer(module: str) -> int | None:
    """The index in LAYERS of the most specific entry that places ``module``."""
    best: tuple[int, int] | None = None
    for index, layer in enumerate(LAYERS):
        for entry in layer:
            if (module == entry) if entry == "mpckpt" else _under(module, entry):
                if best is None or len(entry) > best[1]:
                    best = (index, len(entry))
    return None if best is None else best[0]


def upward(graph: Graph) -> list[str]:
    """Every import that runs up the picture, with where it stands."""
    up = []
    for importer, targets in sorted(graph.items()):
        mine = _layer(importer)
        for target, sites in sorted(targets.items()):
            theirs = _layer(target)
            if mine is not None and theirs is not None and theirs > mine:
                up.append(f"{importer} (layer {mine}) -> {target} (layer {theirs}): "
                          + ", ".join(str(site) for site in sites))
    return up


def test_the_picture_check_sees_an_import_that_runs_up() -> None:
    site = Site("mpckpt/format/x.py", 3, "lazy")
    assert upward({"mpckpt.format.x": {"mpckpt._runtime": [site]}, "mpckpt._runtime": {"mpckpt.format.x": [site]}}) \
        == ["mpckpt.format.x (layer 0) -> mpckpt._runtime (layer 6): mpckpt/format/x.py:3 (lazy)"]
    assert _layer("mpckpt._opening") == _layer("mpckpt._runtime") and _layer("mpckpt") == _layer("mpckpt.checkpointer")


def test_every_import_follows_the_picture() -> None:
    up = upward(build_graph(PACKAGE_ROOT, "mpckpt"))
    assert not up, "imports that run up the picture (LAYERS); move the piece to its layer:\n" + "\n".join(up)


def test_every_module_has_a_layer() -> None:
    graph = build_graph(PACKAGE_ROOT, "mpckpt")
    placed = [entry for layer in LAYERS for entry in layer]
    for entry in placed:  # an entry that names no module has gone stale (a rename, a typo)
        assert entry in graph, f"LAYERS names {entry}, which is no module"
    homeless = [m for m in sorted(graph) if m != "mpckpt" and not any(_under(m, e) for e in placed if e != "mpckpt")]
    assert not homeless, f"modules with no place in LAYERS (add each to the layer it belongs to): {homeless}"


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")


def test_graph_builder_finds_planted_circles(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    _write(root, {
        "__init__.py": "from pkg.top import Facade\n",
        "top.py": "import pkg.low.a\nfrom pkg import top\n",  # the second one is a self edge: skipped
        "low/__init__.py": "",
        "low/a.py": "from pkg.low import b\nimport os\n",
        "low/b.py": "def late():\n    from pkg.low.a import thing\n",  # lazy: still an edge
        "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.rel import x\n",
        "rel.py": "from . import typed\nfrom .low.a import name\n",
        "clean.py": "from pkg.low.a import name\n",
    })
    graph = build_graph(root, "pkg")

    assert graph["pkg"] == {"pkg.top": [Site("pkg/__init__.py", 1, "top")]}
    assert set(graph["pkg.top"]) == {"pkg.low.a"}  # no implicit edges to pkg or pkg.low
    assert graph["pkg.low.a"] == {"pkg.low.b": [Site("pkg/low/a.py", 1, "top")]}
    assert graph["pkg.low.b"] == {"pkg.low.a": [Site("pkg/low/b.py", 2, "lazy")]}
    assert graph["pkg.typed"] == {"pkg.rel": [Site("pkg/typed.py", 3, "typing")]}
    assert set(graph["pkg.rel"]) == {"pkg.typed", "pkg.low.a"}

    assert [c for c in strongly_connected(graph) if len(c) > 1] == [
        ["pkg.low.a", "pkg.low.b"], ["pkg.rel", "pkg.typed"],
    ]
    assert circles(graph) == [
        ["pkg.low.a", "pkg.low.b", "pkg.low.a"], ["pkg.rel", "pkg.typed", "pkg.rel"],
    ]
    report = describe_circles(graph)
    assert "pkg.low.b -> pkg.low.a: pkg/low/b.py:2 (lazy)" in report
    assert "pkg.typed -> pkg.rel: pkg/typed.py:3 (typing)" in report

    rules = [Rule("pkg.low", ("pkg.top",), "low stays low"), Rule("pkg.clean", ("pkg.low",), "demo")]
    assert violations(graph, rules) == [
        "pkg.clean -> pkg.low.a (pkg/clean.py:1): pkg.clean must not import pkg.low; demo",
    ]
