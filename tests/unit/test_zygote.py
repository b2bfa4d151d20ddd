"""Which jobs the tests' job server (tests/helpers/zygote.py) can fork, by PYTHONPATH (``more_path``): a job's
own entries are those before the server's; any other path (another, reordered, in part, an empty entry first)
is no fit, and the job gets a fresh interpreter."""

from __future__ import annotations


def test_a_jobs_own_pythonpath_entries_are_those_before_the_servers():
    from helpers.zygote import more_path

    assert more_path("/t:/u", "/t:/u") == [] and more_path("", "") == []
    assert more_path("/t:/u", "/pkg:/t:/u") == ["/pkg"] and more_path("/t", "/a:/b:/t") == ["/a", "/b"]
    assert more_path("", "/pkg") == ["/pkg"]
    # another path, the server's entries in another order or only in part, or an empty entry (the working dir)
    for job in ("/x", "/u:/t", "/pkg:/t", "/t:/u:/pkg", ":/t:/u"):
        assert more_path("/t:/u", job) is None, job
