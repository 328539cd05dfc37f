"""The training corpus of the default model: text that every Python installation carries.

The project's own README and docs, then the documentation of the standard library rendered as
plain text by `pydoc` (the same text `help(module)` shows), so that the tail a trainer holds out
for validation is standard-library text, unchanged when the project's documents are edited. Nothing is downloaded. The
output is deterministic for one Python version: modules are taken in sorted order, and
what varies between machines or runs (file paths, memory addresses) is stripped.

License: the standard library's docstrings are part of CPython, under the Python Software
Foundation License (PSF-2.0); the project's own documents are the project's.

    python -m model.training.corpus --out corpus.txt            # writes corpus.txt and corpus.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import json
import logging
import pydoc
import re
import sys
import warnings
from pathlib import Path

logger = logging.getLogger(__name__)

# Modules whose import has side effects (opens a browser, prints, needs a display or a
# platform this is not), and packages that are tests or data rather than documentation.
SKIP = frozenset({
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "pydoc_data",
    "ensurepip", "venv", "lib2to3", "msilib", "winreg", "winsound", "nt", "msvcrt", "_winapi",
    "__hello__", "__phello__", "xxsubtype", "xxlimited", "xxlimited_35", "idle",
})
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_ENVIRON = re.compile(r"environ\(\{[^}]*\}\)")  # os.environ's repr as a default value
# Sections that show this machine rather than the library: paths, URLs, module-level data
# (sys.path, site.USER_BASE, ...).
_DROPPED_SECTIONS = ("FILE", "MODULE REFERENCE", "DATA")
SEPARATOR = "\n\n"


def stdlib_modules() -> list[str]:
    """Public standard-library module names, sorted."""
    names = getattr(sys, "stdlib_module_names", ())
    return sorted(n for n in names if not n.startswith("_") and n not in SKIP)


def render_module(name: str) -> str | None:
    """`help(name)` as plain text, with paths and addresses removed; None if it cannot import."""
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
            text = pydoc.render_doc(module, renderer=pydoc.plaintext)
    except Exception as exc:  # noqa: BLE001 - a module that cannot load on this platform is skipped
        logger.info("skipping %s: %s", name, type(exc).__name__)
        return None
    return clean(text)


def clean(text: str) -> str:
    """Drop what differs between machines or runs: paths, URLs, module data, memory addresses,
    the environment, the installation prefix and the home directory."""
    lines = []
    skipping = False
    for line in text.splitlines():
        if line.strip() in _DROPPED_SECTIONS and not line.startswith(" "):
            skipping = True  # the section's body is indented below its title
            continue
        if skipping and (line.startswith("    ") or not line.strip()):
            continue
        skipping = False
        line = _ENVIRON.sub("os.environ", _ADDRESS.sub("", line))
        for prefix in sorted({sys.prefix, sys.base_prefix, sys.exec_prefix}, key=len, reverse=True):
            line = line.replace(prefix, "<prefix>")
        line = line.replace(str(Path.home()), "~")
        lines.append(line.rstrip())
    return "\n".join(lines).strip() + "\n"


def project_docs(root: Path) -> list[str]:
    """The README, then the docs site's pages (docs/**/*.md) in sorted order, relative to `root`."""
    pages = sorted(p.relative_to(root).as_posix() for p in (root / "docs").rglob("*.md"))
    return [rel for rel in ["README.md", *pages] if (root / rel).is_file()]


def build(modules: list[str], project_root: Path | None) -> tuple[str, dict]:
    """The corpus text and its manifest (sources, sizes, sha256, Python version, license)."""
    parts: list[str] = []
    docs: list[str] = []
    if project_root is not None:  # first, so that the held-out tail is standard-library text only
        for rel in project_docs(project_root):
            parts.append((project_root / rel).read_text(encoding="utf-8"))
            docs.append(rel)
    used: list[str] = []
    for name in modules:
        text = render_module(name)
        if text:
            parts.append(text)
            used.append(name)
    corpus = SEPARATOR.join(parts)
    data = corpus.encode("utf-8")
    manifest = {
        "python": sys.version.split()[0],
        "modules": used,
        "project_docs": docs,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "license": "standard library docstrings: PSF-2.0 (CPython); project documents: the project's",
    }
    return corpus, manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="corpus text file; a .json manifest is written beside it")
    ap.add_argument("--modules", nargs="*", help="only these modules (default: the whole standard library)")
    ap.add_argument("--project-root", default=str(Path(__file__).resolve().parents[2]),
                    help="where README.md and docs/ are read from ('' for none)")
    args = ap.parse_args(argv)
    modules = args.modules if args.modules is not None else stdlib_modules()
    root = Path(args.project_root) if args.project_root else None
    corpus, manifest = build(modules, root)
    out = Path(args.out)
    out.write_text(corpus, encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"{out}: {manifest['bytes']:,} bytes from {len(manifest['modules'])} modules "
          f"and {len(manifest['project_docs'])} project documents, sha256 {manifest['sha256'][:16]}")


if __name__ == "__main__":
    main()
