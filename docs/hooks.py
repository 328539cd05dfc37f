"""mkdocs hooks (mkdocs.yml `hooks:`): the generated parts of the pages (mkdocs.yml's exclude_docs
keeps this file and the generator out of the site).

`on_page_markdown` replaces each `<!-- generated: ... -->` marker line with what docs/generate.py
makes from the code and from docs/results/*.json (the argument reference, the metrics table, the
benchmark tables); an unknown marker, argument or result file fails the build.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location("qkv_docs_generate", Path(__file__).with_name("generate.py"))
generate = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(generate)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return generate.render_page(markdown)
