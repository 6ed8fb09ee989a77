"""Test options (slow tests run only with --slow; CI passes it) and the base dir the training tests share."""

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


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A NANOMUON_BASE_DIR with the embedded corpus and a small tokenizer trained on it."""
    from nanomuon.dataset import iter_texts
    from nanomuon.tokenizer import Tokenizer

    base = tmp_path_factory.mktemp("nanomuon")
    mp = pytest.MonkeyPatch()
    mp.setenv("NANOMUON_BASE_DIR", str(base))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        mp.delenv(key, raising=False)
    Tokenizer.train(iter_texts("embedded", "train", 1_000_000), vocab_size=512).save(base / "tokenizer")
    yield base
    mp.undo()
