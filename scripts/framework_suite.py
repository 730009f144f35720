"""Run a framework's own tests twice, as they are and with mpckpt injected, and print what changed.

A tool for us, not part of CI (CI cannot fetch the frameworks' sources). This script owns the
runs and the comparison; the injection itself lives in the pytest plugins beside it
(``scripts/framework_suites/inject_<framework>.py``). Nothing of the frameworks is copied into
this repository: ``--tests`` names a checkout of the framework's public source at the installed
version's tag, kept beside the project (see docs/integrations/lightning.md and transformers.md)::

    .venv/bin/python scripts/framework_suite.py lightning --tests ../framework-tests/lightning
    .venv/bin/python scripts/framework_suite.py transformers --tests ../framework-tests/transformers -k Resume

Each run is ``pytest`` in the checkout, with the framework's own conftest and configuration,
on the CPU, ``-p no:cacheprovider``, ``--timeout`` per test when pytest-timeout is installed,
results read from ``--junitxml``. The baseline runs first. Printed: the counts of each run, the
tests the injection reached, and every test that passed in the baseline but fails or errors
with mpckpt, grouped by the first line of its error. Exit status 0 whatever the tests do; 2
when the runner itself cannot run or read a run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGINS = os.path.join(HERE, "framework_suites")

# per framework: the folder pytest runs in (relative to --tests) and the default subset
SUBSETS = {
    "lightning": ("tests", ["tests_pytorch/checkpointing", "tests_pytorch/plugins/test_checkpoint_io_plugin.py"]),
    "transformers": (".", ["tests/trainer/test_trainer_checkpointing.py"]),
}
PROPERTIES = ("mpckpt_injected", "mpckpt_kept_own", "mpckpt_resumes")


@dataclass
class Result:
    outcome: str                      # passed | failed | errored | skipped
    message: str = ""                 # the first line of the failure, error or skip reason
    props: dict[str, int] = field(default_factory=dict)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("framework", choices=sorted(SUBSETS))
    parser.add_argument("--tests", required=True, help="the framework's checkout (its repository root)")
    parser.add_argument("--subset", nargs="+", help="test paths relative to the run folder (default: the named subset)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--root-outside", action="store_true",
                        help="mpckpt roots in temporary folders, not inside the checkpoint/output folders")
    parser.add_argument("--discard-newer", action="store_true",
                        help="transformers: MpckptCallback(root, discard_newer=True), as the Trainer overwrites")
    parser.add_argument("--resume-path", action="store_true",
                        help="transformers: trainer_folders=False, resumes routed through resume_path")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test (pytest-timeout), default 300")
    parser.add_argument("--injected-only", action="store_true", help="skip the baseline run")
    parser.add_argument("--keep", help="folder for the junit files and logs (default: a temporary one)")
    args = parser.parse_args(argv)

    if (args.discard_newer or args.resume_path) and args.framework != "transformers":
        parser.error("--discard-newer and --resume-path are options of MpckptCallback (transformers)")
    folder, default_subset = SUBSETS[args.framework]
    cwd = os.path.join(os.path.abspath(args.tests), folder)
    if not os.path.isdir(cwd):
        print(f"framework_suite: no folder {cwd}: --tests must name a checkout of {args.framework}'s source",
              file=sys.stderr)
        return 2
    out = args.keep or tempfile.mkdtemp(prefix=f"framework-suite-{args.framework}-")
    print(f"{args.framework} {importlib.metadata.version(args.framework)}, tests from {cwd}; mpckpt at {_git_head()}")
    os.makedirs(out, exist_ok=True)
    runs: dict[str, dict[str, Result]] = {}
    for mode in ("baseline", "injected"):
        if mode == "baseline" and args.injected_only:
            continue
        try:
            runs[mode] = run(mode, args, cwd, args.subset or default_subset, out)
        except (OSError, ET.ParseError, RuntimeError) as e:
            print(f"framework_suite: the {mode} run could not be read: {e}", file=sys.stderr)
            return 2
    report(runs, args.framework)
    print(f"\njunit files and pytest output: {out}")
    return 0


def run(mode: str, args: argparse.Namespace, cwd: str, subset: list[str], out: str) -> dict[str, Result]:
    """One pytest run in ``cwd``; its results by test id."""
    junit = os.path.join(out, f"{mode}.xml")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", *subset]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append(f"--timeout={args.timeout}")
    if args.keyword:
        cmd += ["-k", args.keyword]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # CPU only, whatever the machine has
    if mode == "injected":
        cmd += ["-p", f"inject_{args.framework}"] + (["--mpckpt-root-outside"] if args.root_outside else [])
        cmd += ["--mpckpt-discard-newer"] if args.discard_newer else []
        cmd += ["--mpckpt-resume-path"] if args.resume_path else []
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PLUGINS, env.get("PYTHONPATH", "")) if p)
    log_path = os.path.join(out, f"{mode}.log")
    print(f"[{mode}] {' '.join(cmd)}  (in {cwd})", flush=True)
    started = time.monotonic()
    with open(log_path, "w") as log:
        subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    print(f"[{mode}] {time.monotonic() - started:.0f} s wall; output in {log_path}", flush=True)
    if not os.path.exists(junit):
        raise RuntimeError(f"pytest wrote no {junit}; the end of {log_path}:\n{_tail(log_path)}")
    return parse_junit(junit)


def parse_junit(path: str) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        props = {p.get("name", ""): int(p.get("value", "0")) for p in case.iter("property")
                 if p.get("name") in PROPERTIES}
        outcome, message = "passed", ""
        for tag, name in (("failure", "failed"), ("error", "errored"), ("skipped", "skipped")):
            node = case.find(tag)
            if node is not None:
                outcome, message = name, _first_line(node.get("message") or node.text or "")
                break
        previous = results.get(test_id)  # a teardown error comes as a second entry of the same test
        if previous is not None:
            if previous.message and message:
                message = f"{previous.message} | then {message}"
            outcome = max(outcome, previous.outcome, key=_rank)
            props = props or previous.props
        results[test_id] = Result(outcome, message or (previous.message if previous else ""), props)
    return results


def report(runs: dict[str, dict[str, Result]], framework: str) -> None:
    print(f"\n== {framework}: counts")
    for mode, results in runs.items():
        counts = {k: sum(r.outcome == k for r in results.values()) for k in ("passed", "failed", "errored", "skipped")}
        print(f"  {mode:9} {len(results):4} tests: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    injected = runs.get("injected", {})
    for prop in PROPERTIES:
        tests = [t for t, r in injected.items() if r.props.get(prop)]
        if tests:
            print(f"  {prop}: {len(tests)} tests ({sum(injected[t].props[prop] for t in tests)} times)")
    kept = sorted(t for t, r in injected.items() if r.props.get("mpckpt_kept_own"))
    if kept:
        print("\n== not injected: the test gives the Trainer its own CheckpointIO")
        for t in kept:
            print(f"  {t} ({injected[t].outcome})")
    baseline = runs.get("baseline")
    if baseline is None:
        return
    broken: dict[str, list[tuple[str, str]]] = defaultdict(list)  # masked message -> (test, its message)
    for test_id, before in baseline.items():
        after = injected.get(test_id)
        if before.outcome == "passed" and after is not None and after.outcome in ("failed", "errored"):
            broken[_normalize(after.message)].append((f"{test_id} ({after.outcome})", after.message))
    print(f"\n== passed in the baseline, failed or errored with mpckpt: {sum(map(len, broken.values()))}")
    for group in sorted(broken.values(), key=lambda g: (-len(g), g[0][1])):
        print(f"\n  [{len(group)}] {group[0][1]}")
        for test, _ in sorted(group):
            print(f"      {test}")
    other = [f"{t}: {b.outcome} -> {injected[t].outcome if t in injected else 'not run'}"
             for t, b in baseline.items()
             if (t not in injected or injected[t].outcome != b.outcome) and not (
                 b.outcome == "passed" and t in injected and injected[t].outcome in ("failed", "errored"))]
    other += [f"{t}: not run -> {r.outcome}" for t, r in injected.items() if t not in baseline]
    if other:
        print(f"\n== other changes: {len(other)}")
        for line in sorted(other):
            print(f"  {line}")


def _rank(outcome: str) -> int:
    return {"passed": 0, "skipped": 1, "errored": 2, "failed": 3}[outcome]


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:160]


def _normalize(message: str) -> str:
    """The message with what differs per test (temporary paths, addresses, numbers) masked, to group by."""
    message = re.sub(r"(/tmp|/var/folders)/[^\s'\",)]*", "<tmp>", message)
    message = re.sub(r"0x[0-9a-f]+", "0x…", message)
    return re.sub(r"\d+", "N", message)


def _git_head() -> str:
    """This checkout's commit, ``+changes`` when its tracked files differ from it."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=HERE, capture_output=True, text=True, check=False).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def _tail(path: str, lines: int = 20) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


if __name__ == "__main__":
    sys.exit(main())
