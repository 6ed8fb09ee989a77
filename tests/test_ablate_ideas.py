"""
An ideas file outside the library (--ideas), a variant's settings by value, and a sweep of one
variant's own settings: keys that hold no memory address, options set where they are written out
here, a missing file refused in one line, and (heavy) real ablate invocations that hit the cache for
a function-valued variant and re-run only an edited ideas file's variants.
"""

import json
import os
import subprocess
import sys

import pytest
from test_ablate import TINY
from test_train import REPO

from nanomuon import ideas, stages
from nanomuon.variants import OPTIMIZER_VARIANTS

IDEAS = '''
"""A function-valued variant and a stage of its own, as a user writes them."""
from nanomuon.optim import MuonAdamW
from nanomuon.stages import POST_PROCESSORS, Stage
from nanomuon.variants import OPTIMIZER_VARIANTS

SHRINK = 0.9


def plain_muon_adamw(groups):
    return MuonAdamW(groups)


def shrink(u, ctx):
    return u.mul_(SHRINK)


POST_PROCESSORS["shrink"] = Stage(shrink)
OPTIMIZER_VARIANTS["mine"] = dict(optimizer_class=plain_muon_adamw)
OPTIMIZER_VARIANTS["muon-shrink"] = dict(muon_options=dict(post_process=("shrink",)))
'''


@pytest.fixture
def registries():
    """The registries and the loaded files as they were, after a test that loads an ideas file."""
    kept = {k: dict(r) for k, r in ideas.registries().items()}
    loaded = dict(ideas.LOADED)
    yield
    for k, r in ideas.registries().items():
        r.clear()
        r.update(kept[k])
    ideas.LOADED.clear()
    ideas.LOADED.update(loaded)


def key_in_a_process(path) -> str:
    code = (f"import json; from nanomuon import ideas; ideas.load({str(path)!r}); "
            "print(json.dumps(ideas.settings_key(ideas.OPTIMIZER_VARIANTS['mine'])))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    return out.strip().splitlines()[-1]


@pytest.mark.heavy
def test_a_function_valued_variant_is_keyed_by_value_in_every_process(tmp_path, registries):
    """Two processes key the same function alike, and the key holds no address (its repr does);
    a function's closure and its source each change the key."""
    path = tmp_path / "my_ideas.py"
    path.write_text(IDEAS)
    first, second = key_in_a_process(path), key_in_a_process(path)
    assert first == second and "0x" not in first and "plain_muon_adamw" in first
    ideas.load(str(path))
    assert " at 0x" in repr(OPTIMIZER_VARIANTS["mine"])  # what a repr-keyed cache never hits

    def factory(scale):
        return lambda u: u * scale

    assert ideas.settings_key(factory(2)) != ideas.settings_key(factory(3))
    path.write_text(IDEAS.replace("return MuonAdamW(groups)", "return MuonAdamW(groups, None)"))
    assert key_in_a_process(path) != first


def test_an_ideas_file_owns_only_the_variants_it_defines(tmp_path, registries, capsys):
    """New variants are the file's; one that replaces an existing stage makes every variant its."""
    path = tmp_path / "my_ideas.py"
    path.write_text(IDEAS)
    loaded = ideas.load(str(path))
    assert loaded.variants == {"mine", "muon-shrink"} and loaded.files == (path.resolve(),)
    assert "running it as your code" in capsys.readouterr().out
    assert ideas.load(str(path)) is loaded  # once per process
    assert ideas.ideas_of("mine") == [loaded] and ideas.ideas_of("muon") == []
    other = tmp_path / "replaces.py"
    other.write_text("from nanomuon import stages\n"
                     "stages.POST_PROCESSORS['contra'] = stages.Stage(lambda u, ctx: u)\n")
    assert ideas.load(str(other)).variants == set(OPTIMIZER_VARIANTS)
    assert stages.POST_PROCESSORS["contra"].fn.__name__ == "<lambda>"


@pytest.mark.parametrize("path,says", [("missing.py", "no such file"), pytest.param(
    ".", "not a regular file", marks=pytest.mark.heavy)])
def test_an_ideas_path_that_is_no_file_is_refused_in_one_line(tmp_path, path, says):
    for script in ("scripts.base_train", "scripts.ablate"):
        r = subprocess.run([sys.executable, "-m", script, "--ideas", str(tmp_path / path)],
                           cwd=REPO, capture_output=True, text=True)
        line = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and f"--ideas {tmp_path / path}: {says}; name a Python" in line, (
            script, r.stderr)


def test_an_option_lands_where_its_path_says():
    """A Muon option by its name, a key of the variant's own, a dotted path through a role (whose
    name holds dots); the registry's entry stays as it was."""
    newton = {k: dict(v) for k, v in OPTIMIZER_VARIANTS["muon-newton"].items()}
    got = ideas.with_options("muon-newton", ["precondition_frequency=10", "per_head=True",
                                             "roles.attn.proj.lr_factor=2.5", "apply='cautious'",
                                             "roles.attn.qkv.lr_factor=0.5", "nesterov=False"])
    assert got == dict(
        muon_options=dict(precondition="newton", input_interval=0.02, post_process=(),
                          apply="cautious", precondition_frequency=10, nesterov=False),
        roles={"attn.proj": dict(lr_factor=2.5), "attn.qkv": dict(lr_factor=0.5),
               "mlp.fc": dict(lr_factor=1.5, weight_decay_factor=1.5),
               "mlp.proj": dict(lr_factor=1.5)},
        per_head=True)
    assert OPTIMIZER_VARIANTS["muon-newton"] == newton


def test_a_variant_sweep_runs_the_others_once_and_checks_each_value():
    from scripts.ablate import parse_args

    args, _ = parse_args(["--variants", "muon,muon-soap", "--sweep",
                          "muon-soap:precondition_frequency=20,5,10"])
    assert args.sweep == ("precondition_frequency", ["5", "10", "20"], "muon-soap", True, ())
    assert [args.sweep.of(v) for v in args.variants] == [["-"], ["5", "10", "20"]]
    assert args.sweep.run_flags("5") == ["--variant-option", "precondition_frequency=5"]
    args, _ = parse_args(["--variants", "muon,adamw", "--sweep", "adamw:lr-multiplier=1,4"])
    assert not args.sweep.option and args.sweep.run_flags("4") == ["--lr-multiplier", "4"]
    with pytest.raises(SystemExit):
        parse_args(["--variants", "muon,muon-soap", "--sweep", "muon-soap:soap_beta=0.9,2"])


def ablate(base, *args) -> list[str]:
    """ablate's own lines (not its runs' echoed ones)."""
    r = subprocess.run([sys.executable, "-m", "scripts.ablate", *args], cwd=REPO, text=True,
                       capture_output=True, env=dict(os.environ, NANOMUON_BASE_DIR=str(base)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [line for line in r.stdout.splitlines() if line.startswith("== ")]


@pytest.mark.heavy
def test_two_ablates_hit_the_cache_and_an_edit_reruns_only_its_variants(base, tmp_path):
    """A function-valued variant from an ideas file, swept alone while muon runs once: a second
    invocation launches nothing; an edited ideas file re-runs its variant's runs alone; a sweep of
    a variant's option trains it through --variant-option, muon still cached."""
    path = tmp_path / "my_ideas.py"
    path.write_text(IDEAS)
    small = [*TINY, "--total-batch-size", "256", "--num-iterations", "4", "--eval-every", "2",
             "--no-compile", "--baseline-lengths", "none", "--jobs", "2", "--seeds", "2",
             "--name", "ideas"]
    sweep = ["--ideas", str(path), "--variants", "muon,mine", "--sweep", "mine:lr-multiplier=1,2"]

    def launched(lines):
        return sorted(line.split(":")[0][3:] for line in lines if "scripts.base_train" in line)

    first = ablate(base, *sweep, *small)
    assert launched(first) == ["mine lr-multiplier 1 seeds 1-2 batched",
                               "mine lr-multiplier 2 seeds 1-2 batched", "muon seeds 1-2 batched"]
    mine = [line for line in first if line.startswith("== mine lr-multiplier 1")][0]
    assert f"--ideas {path}" in mine and "--ideas" not in [
        line for line in first if line.startswith("== muon seeds")][0]
    second = ablate(base, *sweep, *small)
    assert launched(second) == [] and sum(": cached (" in line for line in second) == 3
    path.write_text(IDEAS.replace("SHRINK = 0.9", "SHRINK = 0.8"))
    third = ablate(base, *sweep, *small)
    assert launched(third) == ["mine lr-multiplier 1 seeds 1-2 batched",
                               "mine lr-multiplier 2 seeds 1-2 batched"]
    assert any(line.startswith("== muon seeds 1-2 batched: cached") for line in third), third
    fourth = ablate(base, "--variants", "muon,muon-soap", "--sweep",
                    "muon-soap:precondition_frequency=1,2", *small)
    assert launched(fourth) == ["muon-soap precondition_frequency 1 seeds 1-2 batched",
                                "muon-soap precondition_frequency 2 seeds 1-2 batched"]
    meta = json.loads(next((base / "runs" / "ideas-muon-soap-precondition_frequency2-s1-2")
                           .glob("step_*/meta.json")).read_text())
    assert meta["args"]["variant_option"] == ["precondition_frequency=2"]
    table = (base / "ablations" / "ideas" / "ablation.md").read_text()
    assert "| muon | - |" in table and "At the edge of the sweep: muon-soap" in table


def test_fsdp_is_refused_for_a_stage_an_option_sets_that_shards_cannot_run(capsys):
    """--fsdp checks the variant as --variant-option leaves it: muon with apply=hyperball (it reads
    whole weights) is refused naming the stage, as muon-hyperball is; muon itself parses."""
    from scripts.train_args import parse_args

    base = ["--dataset", "embedded", "--device-type", "cpu", "--depth", "2", "--fsdp"]
    for flags in (["--optimizer", "muon", "--variant-option", "apply=hyperball"],
                  ["--optimizer", "muon-hyperball"]):
        with pytest.raises(SystemExit):
            parse_args([*base, *flags])
        said = capsys.readouterr().err
        assert "apply 'hyperball' reads whole weight matrices" in said and "drop --fsdp" in said
    assert parse_args([*base, "--optimizer", "muon"]).fsdp
