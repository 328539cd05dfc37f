"""What the pages name exists, and the pages speak to the user.

- Every repository path a page names (`model/...`, `service/...`, `tests/...`, `deploy/...`,
  `loadtests/...`, `docs/...`, `examples/...`, `.ci/...`) exists: a file, a folder, or a glob that
  matches something. Pages: docs/**/*.md and README.md. The generated parts are left out: they
  quote the code and the result files, which tests/docs/test_docs_generated.py keeps current.
- No page cites an issue ("issue 42", "#42") or says "this machine": a reader has another
  machine, and the history of a figure belongs in the changelog. Figures name their hardware.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.paths import REPO

ROOTS = ("model", "service", "tests", "deploy", "loadtests", "docs", "examples", ".ci")
PATH = re.compile(r"(?<![\w./~:-])((?:" + "|".join(re.escape(r) for r in ROOTS) + r")/[\w./*{}-]*)")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.\w+)?$|[<{]")  # docs/results/NAME.json, <dir>/x
ISSUE = re.compile(r"\b(?:issues?|PR|pull request)\s+#?\d+\b|(?<![\w&/#-])#\d+\b", re.I)
THIS_MACHINE = re.compile(r"\bthis (?:[\w-]+ )?(?:machine|box|host|VM)\b|\bproject's machine\b"
                          r"|\bthe lent (?:H\d+|GPU|machine)\b", re.I)
START = re.compile(r"^<!-- generated: .*-->$")
END = "<!-- end generated -->"


def pages() -> list[Path]:
    return sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]


def written_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of what the page's author wrote: generated blocks left out."""
    out, inside = [], False
    for number, line in enumerate(text.split("\n"), 1):
        if START.match(line.strip()):
            inside = True
        elif line.strip() == END:
            inside = False
        elif not inside:
            out.append((number, line))
    return out


def named_paths(text: str) -> list[tuple[int, str]]:
    """(line number, path) of each repository path the page names."""
    out = []
    for number, line in written_lines(text):
        for match in PATH.finditer(line):
            path = match[1].rstrip(".,:;")
            if any(PLACEHOLDER.search(part) for part in path.split("/")):
                continue
            out.append((number, path))
    return out


def exists(path: str) -> bool:
    if "*" in path:
        return any(REPO.glob(path))
    return (REPO / path).exists()


def test_every_path_the_pages_name_exists() -> None:
    missing, found = [], 0
    for page in pages():
        for number, path in named_paths(page.read_text()):
            found += 1
            if not exists(path):
                missing.append(f"{page.relative_to(REPO)}:{number}: {path}")
    assert found > 100, found  # the extraction finds the pages' paths
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_the_path_extraction_finds_paths_and_skips_the_rest() -> None:
    text = ("See `model/engine/scheduler.py`, (tests/model/), deploy/grafana/dashboards/*.json and "
            "docs/results/NAME.json.\nhttps://example.com/docs/x.md, ./model/x, my-serve.yaml\n"
            "<!-- generated: arguments -->\nservice/nowhere.py\n<!-- end generated -->\nservice/app.py.")
    assert named_paths(text) == [(1, "model/engine/scheduler.py"), (1, "tests/model/"),
                                 (1, "deploy/grafana/dashboards/*.json"), (6, "service/app.py")]
    assert not exists("model/no_such_file.py") and exists("deploy/grafana/dashboards/*.json")


def wording_problems(text: str, where: str) -> list[str]:
    out = []
    for number, line in written_lines(text):
        for pattern, what in ((ISSUE, "cites an issue"), (THIS_MACHINE, "says 'this machine'")):
            for match in pattern.finditer(line):
                out.append(f"{where}:{number}: {what}: {match[0]!r}")
    return out


def test_pages_cite_no_issue_and_no_machine_of_their_own() -> None:
    problems = [p for page in pages() for p in wording_problems(page.read_text(), str(page.relative_to(REPO)))]
    assert not problems, "\n".join(problems)


def test_the_wording_check_finds_what_it_looks_for() -> None:
    text = ("Fixed in issue 42 (#17); on this machine it runs.\nSee [the section](#the-section), top-1, "
            "&#8212;, C# 7 and issues; on this 2-core VM, on the lent H200.\n")
    assert wording_problems(text, "p") == ["p:1: cites an issue: 'issue 42'", "p:1: cites an issue: '#17'",
                                           "p:1: says 'this machine': 'this machine'",
                                           "p:2: says 'this machine': 'this 2-core VM'",
                                           "p:2: says 'this machine': 'the lent H200'"]
