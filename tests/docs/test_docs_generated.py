"""The generated parts of the docs are committed in the pages and current: regenerating every
`<!-- generated: ... -->` block from the code and docs/results/*.json gives the committed text.
A page that differs fails with the command that rewrites it (`python docs/generate.py --write`).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import pytest

from tests.support.docs_generator import load_generate
from tests.support.paths import REPO

generate = load_generate()


def test_every_generated_part_of_the_docs_is_current() -> None:
    pages = generate.pages()
    assert len(pages) > 20 and any("<!-- generated: arguments -->" in p.read_text() for p in pages)
    problems = []
    for page in pages:
        text = page.read_text()
        fresh = generate.update_page(text)
        if fresh != text:
            diff = difflib.unified_diff(text.splitlines(), fresh.splitlines(), "committed", "generated now",
                                        n=0, lineterm="")
            problems.append(f"{page.relative_to(REPO)}: its generated text is out of date; run "
                            f"`.venv/bin/{generate.WRITE_COMMAND}` and commit the page.\n"
                            + "\n".join(list(diff)[:12]))
    assert not problems, "\n\n".join(problems)


def test_each_generated_block_ends_where_it_says() -> None:
    for page in generate.pages():
        lines = page.read_text().split("\n")
        starts = [i for i, line in enumerate(lines) if generate.MARKER.match(line.strip())]
        ends = [i for i, line in enumerate(lines) if line.strip() == generate.END_MARKER]
        assert len(starts) == len(ends), f"{page.relative_to(REPO)}: {len(starts)} start and {len(ends)} end markers"
        assert all(s < e for s, e in zip(starts, ends)), page
        assert all(e < s for e, s in zip(ends, starts[1:])), page


PAGE = """# A page

Before.

<!-- generated: metrics qkv_num_requests -->

an old table

<!-- end generated -->

Between.

<!-- generated: bench demo -->
After.
"""


def _demo_results(tmp_path: Path) -> Path:
    doc = {"benchmark": "demo", "command": "python loadtests/benchmarks/demo.py --out x.json", "date": "2026-12-03",
           "commit": "abc1234", "machine": {"cpu_model": "Some CPU", "cores": 2, "copy_bandwidth_gb_s": 10.0,
                                            "matmul_peak_gflops": 100.0, "gpu": None},
           "table": {"columns": ["case", "tok/s"], "rows": [["a", 12.5]]}}
    (tmp_path / "demo.json").write_text(json.dumps(doc))
    return tmp_path


def test_update_replaces_a_stale_block_and_closes_a_new_one(tmp_path: Path) -> None:
    results = _demo_results(tmp_path)
    out = generate.update_page(PAGE, results)
    assert "an old table" not in out
    assert "`ray_qkv_num_requests_running`" in out and "| a | 12.5 |" in out
    assert out.count(generate.END_MARKER) == 2
    assert out.startswith("# A page\n\nBefore.\n\n<!-- generated: metrics qkv_num_requests -->\n\n|")
    assert out.endswith(f"`abc1234` on Some CPU, 2 cores, copy 10.0 GB/s, float32 matmul 100.0 GFLOP/s, no GPU.\n\n"
                        f"{generate.END_MARKER}\nAfter.\n")
    assert generate.update_page(out, results) == out  # written once, it is current
    assert "Between." in out and "<!--" not in generate.render_page(out, results)


def test_a_changed_source_makes_the_page_stale(tmp_path: Path) -> None:
    results = _demo_results(tmp_path)
    page = tmp_path / "page.md"
    page.write_text(generate.update_page(PAGE, results))
    assert generate.stale_pages([page], results) == []
    doc = json.loads((results / "demo.json").read_text())
    doc["table"]["rows"] = [["a", 13.0]]
    (results / "demo.json").write_text(json.dumps(doc))
    assert generate.stale_pages([page], results) == [page]


def test_bad_markers_fail_with_their_names(tmp_path: Path) -> None:
    for bad, message in (("<!-- end generated -->\n", "without a"),
                         ("<!-- generated: bench nothing -->\n", "nothing"),
                         ("<!-- generated: api_fields nothing -->\n", "known models"),
                         ("<!-- generated: nonsense -->\n", "unknown docs marker")):
        with pytest.raises(ValueError, match=message):
            generate.update_page(bad, tmp_path)


def test_the_command_writes_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = _demo_results(tmp_path)
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    assert generate.main(["--check"], [page], results) == 1 and f"out of date: {page}" in capsys.readouterr().out
    assert page.read_text() == PAGE
    assert generate.main(["--write"], [page], results) == 0 and page.read_text() != PAGE
    assert generate.main(["--check"], [page], results) == 0
    assert generate.main([], [page], results) == 2
