"""
Every fact of a group key lives in its one row (stages.GROUP_KEYS, MUON_OPTIONS, ADAMW_OPTIONS):
the lists the optimizer asks are read from the rows and hold what the hand-written lists held,
and a default is read from its row wherever a group is checked before it is filled in.
"""

import pytest
import torch

from nanomuon import optim, param_groups, stages

# The six lists as they were written by hand, in three files, before the rows held their facts.
# They are the spec the rows are read against.
OLD_REQUIRED_KEYS = {"adamw": ("lr", "betas", "eps", "weight_decay"),
                     "muon": ("lr", "momentum", "ns_steps", "beta2", "weight_decay")}
OLD_PASSIVE_KEYS = {"params", "kind", "name", "initial_lr", "initial_weight_decay",
                    "initial_momentum", "step"}
OLD_LEGACY_KEYS = ("equilibrate", "post_normalize", "cautious_wd")
OLD_NUMBERS = ("lr", "momentum", "weight_decay", "beta2", "betas", "eps", "step", "initial_lr",
               "initial_weight_decay", "initial_momentum")
OLD_STRUCTURAL_KEYS = ("sharded_mode", "comm_precision", "qkv_split", "split", "split_groups",
                       "transposed")
OLD_NOT_MATH = ("params", "kind", "name", "initial_lr", "lr", "momentum", "weight_decay", "beta2",
                "step", "sharded_mode", "comm_precision")

MUON = dict(kind="muon", lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95, weight_decay=0.0)


def test_the_lists_read_from_the_rows_hold_what_the_written_ones_held():
    assert param_groups.REQUIRED_KEYS == OLD_REQUIRED_KEYS  # in order: a refusal lists them so
    assert param_groups.PASSIVE_KEYS == OLD_PASSIVE_KEYS
    assert param_groups.LEGACY_KEYS == OLD_LEGACY_KEYS
    assert sorted(optim.NUMBERS) == sorted(OLD_NUMBERS)
    assert sorted(optim.MuonAdamW.STRUCTURAL_KEYS) == sorted(OLD_STRUCTURAL_KEYS)
    # The written NOT_MATH missed two passive keys base_train adds, which the update never read:
    # read from the rows, every passive key is left out of the compiled graph's constants.
    assert sorted(stages.NOT_MATH) == sorted({*OLD_NOT_MATH, "initial_weight_decay",
                                              "initial_momentum"})


def test_bookkeeping_is_not_a_constant_of_the_math():
    """Groups that differ only in base_train's schedule starts resolve to the same options."""
    base = dict(MUON, params=[], **{k: o.default for k, o in stages.MUON_OPTIONS.items()
                                    if o.stage is None})
    one = stages.muon_options(dict(base, initial_weight_decay=0.1, initial_momentum=0.9), "cpu")
    two = stages.muon_options(dict(base, initial_weight_decay=0.2, initial_momentum=0.8), "cpu")
    assert one == two and "initial_weight_decay" not in one and "ns_steps" in one


def _with_default(monkeypatch, table: dict, key: str, default) -> None:
    monkeypatch.setitem(table, key, table[key]._replace(default=default))


def test_the_checks_read_each_default_from_its_row(monkeypatch):
    """A default changed in its row changes what a group that lacks the key is checked as:
    sharded_mode, ns_coefficients, ns_repeat_last and split_groups are written nowhere else."""
    split = dict(MUON, params=[], split=(2, 2))
    param_groups.check_group_values(0, dict(split))
    with monkeypatch.context() as m:
        _with_default(m, stages.MUON_OPTIONS, "sharded_mode", "distributed")
        with pytest.raises(ValueError, match="split needs whole matrices"):
            param_groups.check_group_values(0, dict(split))

    long = dict(MUON, params=[], ns_steps=10)
    with pytest.raises(ValueError, match="has 5 per-iteration triples"):
        param_groups.check_group_values(0, dict(long))
    with monkeypatch.context() as m:
        _with_default(m, stages.MUON_OPTIONS, "ns_coefficients", "jordan")  # one triple repeats
        param_groups.check_group_values(0, dict(long))
    with monkeypatch.context() as m:
        _with_default(m, stages.MUON_OPTIONS, "ns_repeat_last", True)
        param_groups.check_group_values(0, dict(long))

    grouped = dict(MUON, params=[torch.zeros(8, 4)], split=(2, 2))  # the blocks twice over
    with pytest.raises(ValueError, match="covers 4"):
        param_groups.check_group(0, dict(grouped))
    _with_default(monkeypatch, stages.MUON_OPTIONS, "split_groups", 2)
    param_groups.check_group(0, dict(grouped))


def test_fill_defaults_reads_the_kinds_own_rows(monkeypatch):
    """The update count and an older checkpoint's cautious_wd come from their rows too."""
    _with_default(monkeypatch, stages.GROUP_KEYS["muon"], "step", 7)
    _with_default(monkeypatch, stages.GROUP_KEYS["muon"], "cautious_wd", False)
    group = dict(MUON, params=[], equilibrate="row")
    param_groups.fill_defaults(group)
    assert group["step"] == 7 and group["apply"] == "decoupled", group
    adamw = dict(kind="adamw", params=[], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    param_groups.fill_defaults(adamw)
    assert "step" not in adamw and adamw["momentum"] is None, adamw


def test_every_key_has_one_meaning_in_its_rows():
    """A required key has no default; a key is one sort (required, passive, legacy or an
    option); every row says what it means."""
    for kind in stages.OPTIONS:
        for key, o in stages.group_keys(kind).items():
            assert o.doc, (kind, key)
            assert sum((o.required, o.passive, o.legacy)) <= 1, (kind, key)
            assert not o.required or o.default is stages.NO_DEFAULT, (kind, key)
            is_option = key in stages.OPTIONS[kind]
            assert is_option == (not (o.required or o.passive or o.legacy)), (kind, key)
