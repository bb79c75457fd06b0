"""The files here are test *libraries* (transformers' mixins and our stand-ins), not test modules: pytest collects the
tests that use them from tests/test_transformers_common.py."""

collect_ignore_glob = ["*.py", "*/*.py"]
