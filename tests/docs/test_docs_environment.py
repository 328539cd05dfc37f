"""docs/environment-variables.md names every environment variable the code of model/ and service/
reads, and no `QKV_*` variable that the code does not read."""

from __future__ import annotations

import re

from tests.support.paths import REPO

PAGE = REPO / "docs" / "environment-variables.md"
OWN = re.compile(r"""["'](QKV_[A-Z0-9_]+)["']""")  # our variables: every QKV_* string literal
READ = re.compile(r"""(?:os\.environ\.get\(|os\.getenv\(|os\.environ\[)\s*["']([A-Z][A-Z0-9_]*)["']""")


def variables_in(source: str) -> set[str]:
    return set(OWN.findall(source)) | set(READ.findall(source))


def code_variables() -> set[str]:
    from service.launch import SERVING_ENV

    found = set(SERVING_ENV)
    for part in ("model", "service"):
        for path in (REPO / part).rglob("*.py"):
            found |= variables_in(path.read_text())
    return found


def test_the_page_names_every_variable_the_code_reads() -> None:
    page = PAGE.read_text()
    named = set(re.findall(r"`([A-Z][A-Z0-9_]+)(?:=[^`]*)?`", page))
    found = code_variables()
    assert {"QKV_API_KEY", "QKV_KEEP_FREED_MEMORY", "PATH", "RAY_SERVE_ENABLE_HA_PROXY"} <= found, found
    assert not found - named, f"read by the code, missing from {PAGE.name}: {sorted(found - named)}"
    stale = {n for n in named if n.startswith("QKV_")} - found
    assert not stale, f"{PAGE.name} names QKV_ variables the code does not read: {sorted(stale)}"


def test_the_extraction_finds_reads_and_names() -> None:
    source = ('KEY_ENV = "QKV_SOME_KEY"\nx = os.environ.get("HOME", "/")\ny = os.getenv(\'LANG\')\n'
              'z = os.environ["TERM"]\nw = "not_a_variable"\n')
    assert variables_in(source) == {"QKV_SOME_KEY", "HOME", "LANG", "TERM"}
