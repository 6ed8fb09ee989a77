"""Test options: slow tests (world size 8, torch.compile) run only with --slow; CI passes it."""

import pytest


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run tests marked slow (CI does)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
