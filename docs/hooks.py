"""mkdocs hooks (mkdocs.yml `hooks:`): the check that the generated parts of the pages are current
(mkdocs.yml's exclude_docs keeps this file and the generator out of the site).

The generated text is committed inside each page, between `<!-- generated: ... -->` and
`<!-- end generated -->` (docs/generate.py writes it). `on_page_markdown` leaves the page as it is
and warns when that text differs from what the code and docs/results/*.json give now, so
`mkdocs build --strict` fails on a page nobody regenerated; an unknown marker, argument or result
file fails the build too.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location("qkv_docs_generate", Path(__file__).with_name("generate.py"))
generate = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(generate)

log = logging.getLogger("mkdocs.plugins.qkv_docs")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if generate.update_page(markdown) != markdown:
        log.warning("%s: the generated text is out of date; run `%s` and commit the pages",
                    page.file.src_uri, generate.WRITE_COMMAND)
    return markdown
