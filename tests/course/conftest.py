"""The released notebooks kept as fixtures are graded by the tests, never collected as tests."""

collect_ignore_glob = ["old_notebooks/*"]
