"""scripts/config_reference.py reads the schema's comments: a comment above a field means that one key, a
trailing comment its own, and a rendered row without a meaning of its own is named. The page itself:
tests/integration/test_config_reference.py."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from helpers.jobs import REPO

sys.path.insert(0, str(REPO / "scripts"))
import config_reference  # noqa: E402  (scripts/config_reference.py)

# both tests on one worker: they share that one render
pytestmark = pytest.mark.xdist_group("config_reference")


def test_a_comment_means_the_one_key_under_it():
    """A comment block above one field does not also describe the fields after it (the rank timeout's comment
    was the meaning of four DDP keys); a field's trailing comment is its own."""

    @dataclasses.dataclass
    class Example:
        # the first key's meaning
        first: int = 0
        second: int = 0
        third: int = 0  # the third's own

    assert config_reference.field_comments(Example) == {
        "first": "the first key's meaning",
        "second": "",
        "third": "the third's own",
    }
    table = (
        "| key | default | meaning |\n| --- | --- | --- |\n| `a` | `1` | x |\n| `b` | `2` | x |\n"
        "| `c` | `3` |  |\n"
    )
    assert config_reference.unmeant(table) == ["b: the meaning of a", "c: no meaning"]
