"""The manual's pointers at tests hold: every ``tests/<file>.py::test_name`` in README.md and docs/ names the
file that defines that test (the tiers' split and later splits by topic moved tests; a reader who follows a
guarantee to its test must find it there)."""

from __future__ import annotations

import ast
import re

from helpers.jobs import REPO

POINTER = re.compile(r"(tests/[\w/]+\.py)::(test_\w+)")


def _defined() -> dict[str, set[str]]:
    """test name -> the files (relative to the repository) that define it."""
    out: dict[str, set[str]] = {}
    for path in (REPO / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                out.setdefault(node.name, set()).add(str(path.relative_to(REPO)))
    return out


def test_every_pointer_at_a_test_names_the_file_that_defines_it():
    defined = _defined()
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    pointers = [(page.name, *m.groups()) for page in pages for m in POINTER.finditer(page.read_text())]
    assert len(pointers) >= 40  # the manual points at its tests: this rule sees them
    wrong = [
        f"{page}: {file}::{test} (defined in {sorted(defined.get(test, [])) or 'no file'})"
        for page, file, test in pointers
        if file not in defined.get(test, set())
    ]
    assert wrong == []
