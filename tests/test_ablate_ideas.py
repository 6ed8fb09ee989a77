"""
An ideas file outside the library (--ideas), a variant's settings by value, and a sweep of one
variant's own settings: keys that hold no memory address, options set where they are written out
here, a missing file refused in one line, and (heavy) real ablate invocations that hit the cache for
a function-valued variant and re-run only an edited ideas file's variants.
"""

import copy
import json
import os
import subprocess
import sys

import pytest
from test_ablate import TINY
from test_train import REPO

from nanomuon import ideas, stages
from nanomuon.arch import Variant
from nanomuon.variants import OPTIMIZER_VARIANTS

IDEAS = '''
"""A function-valued variant and a stage of its own, as a user writes them."""
from nanomuon.arch import Variant
from nanomuon.optim import MuonAdamW
from nanomuon.stages import POST_PROCESSORS, Stage
from nanomuon.variants import OPTIMIZER_VARIANTS

SHRINK = 0.9


def plain_muon_adamw(groups):
    return MuonAdamW(groups)


def shrink(u, ctx):
    return u.mul_(SHRINK)


POST_PROCESSORS["shrink"] = Stage(shrink)
OPTIMIZER_VARIANTS["mine"] = Variant(optimizer_class=plain_muon_adamw)
OPTIMIZER_VARIANTS["muon-shrink"] = Variant(muon_options=dict(post_process=("shrink",)))
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
    """A Muon option by its name, a field of the record, an lr by its name, a dotted path through
    a role (whose name holds dots) or into the Muon options; the registry's record stays as it
    was. A path into a field that is no dict is refused."""
    newton = copy.deepcopy(OPTIMIZER_VARIANTS["muon-newton"])
    got = ideas.with_options("muon-newton", ["precondition_frequency=10", "per_head=True",
                                             "roles.attn.proj.lr_factor=2.5", "apply='cautious'",
                                             "roles.attn.qkv.lr_factor=0.5", "nesterov=False",
                                             "matrix_lr=0.04", "muon_options.momentum=0.9",
                                             "muon_options.beta2=None", "weight_decay=0.1"])
    assert got == Variant(
        muon_options=dict(precondition="newton", input_interval=0.02, post_process=(), apply="cautious",
                  precondition_frequency=10, nesterov=False, momentum=0.9, beta2=None),
        roles={"attn.proj": dict(lr_factor=2.5), "attn.qkv": dict(lr_factor=0.5),
               "mlp.fc": dict(lr_factor=1.5, weight_decay_factor=1.5),
               "mlp.proj": dict(lr_factor=1.5)},
        per_head=True, lrs=dict(matrix_lr=0.04), weight_decay=0.1)
    assert OPTIMIZER_VARIANTS["muon-newton"] == newton
    for bad in ("per_head.x=1", "muon_options.nesterov.x=1", "roles.mlp=1"):
        with pytest.raises(ValueError, match=r"a path goes into muon_options, lrs or roles, one key"):
            ideas.with_options("muon", [bad])


def test_a_variant_that_is_no_record_is_refused_in_one_line(monkeypatch):
    """An ideas file of the old spelling (a dict) is told to write a Variant record."""
    monkeypatch.setitem(OPTIMIZER_VARIANTS, "old", dict(muon_options=dict(beta2=None)))
    with pytest.raises(ValueError, match=r"OPTIMIZER_VARIANTS\['old'\] is a dict: a variant is a "
                                         r"record now, Variant\(muon_options=dict"):
        ideas.with_options("old", None)


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


USER_CODE = '''
"""A user's module: imports a helper when it runs, reads a file and a variable."""
import os


def go(data):
    import helper
    with open(data) as f:
        f.read()
    return helper.SCALE, os.environ.get("NANOMUON_TEST_SCALE")
'''


def test_a_process_records_the_code_it_ran_and_what_user_code_read(tmp_path):
    """A helper edited before it is imported and put back after is recorded as the edit (what ran),
    so it no longer matches its file; a file and an environment variable that user code reads are
    named, with the file that read them."""
    import hashlib

    from nanomuon import reads

    (tmp_path / "user.py").write_text(USER_CODE)
    helper, data = tmp_path / "helper.py", tmp_path / "data.txt"
    helper.write_text("SCALE = 1.0\n")
    data.write_text("x")
    code = (f"import sys, json; sys.path.insert(0, {str(tmp_path)!r}); from nanomuon import reads; "
            "reads.start(); import user; from pathlib import Path; h = Path(sys.argv[1]); "
            "h.write_text('SCALE = 0.0\\n'); print(user.go(sys.argv[2])); "
            "h.write_text('SCALE = 1.0\\n'); print(json.dumps(reads.record()))")
    out = subprocess.run([sys.executable, "-c", code, str(helper), str(data)], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "(0.0, None)"
    record = json.loads(out[1])
    user = str((tmp_path / "user.py").resolve())
    assert record["sources"][str(helper.resolve())] == hashlib.sha256(b"SCALE = 0.0\n").hexdigest()
    assert reads.changed(record["sources"]) == [str(helper.resolve())]
    assert str((REPO / "nanomuon" / "reads.py").resolve()) in record["sources"]
    assert record["outside"] == [
        f"the environment variable NANOMUON_TEST_SCALE (read by {user})",
        f"the file {data.resolve()} (read by {user})"], record


GENERATED_READER = "import os\nSEEN = os.environ.get('NANOMUON_TEST_SCALE')\n"


def test_code_torch_compile_writes_is_not_user_code(tmp_path):
    """A module in torch.compile's cache (TORCHINDUCTOR_CACHE_DIR: inductor writes it from the
    library's code) that reads the environment is neither a source nor a read no key holds; the
    same module elsewhere is user code, and its read is named."""
    cache, elsewhere = tmp_path / "inductor" / "ab", tmp_path / "mine"
    for d in (cache, elsewhere):
        d.mkdir(parents=True)
        (d / f"gen_{d.name}.py").write_text(GENERATED_READER)
    code = (f"import sys, json; from nanomuon import reads; reads.start(); "
            f"sys.path[:0] = [{str(cache)!r}, {str(elsewhere)!r}]; import gen_ab, gen_mine; "
            "print(json.dumps(reads.record()))")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout
    record = json.loads(out)
    mine = str((elsewhere / "gen_mine.py").resolve())
    assert record["outside"] == [f"the environment variable NANOMUON_TEST_SCALE (read by {mine})"]
    assert mine in record["sources"] and not any("inductor" in f for f in record["sources"])


@pytest.mark.heavy
def test_a_compiled_step_on_a_cpu_reads_nothing_a_key_misses(tmp_path):
    """torch.compile on a CPU: inductor's generated module reads the environment (its C++ build's)
    as it runs; a compiled run is still cached (nothing outside the key)."""
    code = ("import json, torch; from nanomuon import reads; reads.start(); "
            "f = torch.compile(lambda x: (x * 2).sin()); f(torch.ones(3)); "
            "print(json.dumps(reads.record()['outside']))")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out.splitlines()[-1]) == []


EARLY = '"""An ideas file that imports a helper and registers nothing."""\nimport shared_helper\n'
SCALED = '''
"""A stage that reads two helpers: one imported at load, one when the stage runs."""
import os

import shared_helper
from nanomuon.arch import Variant
from nanomuon.stages import POST_PROCESSORS, Stage
from nanomuon.variants import OPTIMIZER_VARIANTS


def scaled(u, ctx):
    import runtime_helper
    return u.mul_(runtime_helper.SCALE * shared_helper.SCALE)


def from_env(u, ctx):
    return u.mul_(float(os.environ.get("NANOMUON_TEST_SCALE", "1")))


POST_PROCESSORS["scaled"] = Stage(scaled)
POST_PROCESSORS["from_env"] = Stage(from_env)
OPTIMIZER_VARIANTS["scaled"] = Variant(muon_options=dict(post_process=("scaled",)))
OPTIMIZER_VARIANTS["from-env"] = Variant(muon_options=dict(post_process=("from_env",)))
'''


@pytest.mark.heavy
def test_a_helper_edit_reruns_and_an_environment_read_is_never_cached(base, tmp_path):
    """A helper the stage imports as it runs, and one an earlier --ideas file imported first, each
    re-runs the variant when edited; a stage that reads an environment variable is trained every
    time, and the table says why."""
    for name, text in (("early.py", EARLY), ("scaled.py", SCALED),
                       ("runtime_helper.py", "SCALE = 1.0\n"), ("shared_helper.py", "SCALE = 1.0\n")):
        (tmp_path / name).write_text(text)
    small = [*TINY, "--total-batch-size", "256", "--num-iterations", "2", "--eval-every", "2",
             "--no-compile", "--baseline-lengths", "none", "--jobs", "2", "--seeds", "1",
             "--name", "helpers", "--ideas", str(tmp_path / "early.py"),
             "--ideas", str(tmp_path / "scaled.py")]
    env = dict(os.environ, PYTHONPATH=str(tmp_path), NANOMUON_BASE_DIR=str(base))

    def trained(*args) -> tuple[list[str], str]:
        r = subprocess.run([sys.executable, "-m", "scripts.ablate", *small, *args], cwd=REPO,
                           text=True, capture_output=True, env=env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return sorted(line.split(":")[0][3:] for line in r.stdout.splitlines()
                      if "scripts.base_train" in line), r.stdout

    assert trained("--variants", "muon,scaled")[0] == ["muon lr-multiplier 1 seed 1", "scaled lr-multiplier 1 seed 1"]
    assert trained("--variants", "muon,scaled")[0] == []
    for helper in ("runtime_helper.py", "shared_helper.py"):
        (tmp_path / helper).write_text("SCALE = 0.0\n")
        assert trained("--variants", "muon,scaled")[0] == ["scaled lr-multiplier 1 seed 1"], helper
    for _ in range(2):
        runs, out = trained("--variants", "muon,from-env")
        assert runs == ["from-env lr-multiplier 1 seed 1"] and "1 seed 1: not cached: it read the " \
            "environment variable NANOMUON_TEST_SCALE (read by" in out, out
    table = (base / "ablations" / "helpers" / "ablation.md").read_text()
    assert "Not cached: from-env at 1 read the environment variable NANOMUON_TEST_SCALE" in table


@pytest.mark.heavy
def test_an_ideas_file_edited_and_put_back_while_its_run_trains_is_not_cached(
        base, tmp_path, monkeypatch, registries):
    """The run loads the edited file, which is put back before it ends: the tree is the same
    before and after, but the run trained other code, so its result is not cached under the
    original's key (the next ablate trains it again)."""
    from nanomuon.ablation import runs
    from scripts import ablate

    path = tmp_path / "my_ideas.py"
    path.write_text(IDEAS)
    real = runs.launch

    def edited_while_it_runs(label, flags, *args, **kw):
        if label.startswith("muon-shrink"):
            path.write_text(IDEAS.replace("SHRINK = 0.9", "SHRINK = 0.0"))
        try:
            return real(label, flags, *args, **kw)
        finally:
            path.write_text(IDEAS)

    monkeypatch.setattr(runs, "launch", edited_while_it_runs)
    argv = [*TINY, "--total-batch-size", "256", "--num-iterations", "2", "--eval-every", "2",
            "--no-compile", "--baseline-lengths", "none", "--jobs", "1", "--seeds", "1",
            "--name", "reverted", "--ideas", str(path), "--variants", "muon-shrink",
            "--sweep", "muon-shrink:lr-multiplier=1,2"]
    cache = base / "ablations" / "cache"
    before = set(cache.glob("*.json")) if cache.exists() else set()
    with pytest.raises(SystemExit, match=f"{path.resolve()} changed while muon-shrink"):
        ablate.main(argv)
    assert set(cache.glob("*.json")) == before


def test_a_misspelt_role_in_an_ideas_variant_is_one_line_naming_it(tmp_path, registries, capsys):
    """A variant whose roles name no role of the model is refused when base_train starts, naming
    the bad role, not by a traceback once the model is built."""
    from scripts.train_args import parse_args

    path = tmp_path / "typo.py"
    path.write_text("from nanomuon.arch import Variant\nfrom nanomuon.variants import OPTIMIZER_VARIANTS\n"
                    "OPTIMIZER_VARIANTS['typo'] = "
                    "Variant(roles={'lm_haed': dict(lr_factor=2.0), 'mlp.fc': dict(lr_factor=1.5)})\n")
    with pytest.raises(SystemExit):
        parse_args(["--ideas", str(path), "--optimizer", "typo", "--device-type", "cpu"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: --optimizer typo: roles: ['lm_haed'] names no role here; this model's roles " \
        "are ['lm_head'," in line, line


@pytest.mark.parametrize("option,says", [
    ("matrix_lr=1e30", "matrix_lr 1e+30 x --lr-multiplier 1 is not in [0, 1,000]"),
    ("embedding_lr=5000", "embedding_lr 5000 x --lr-multiplier 1 is not in [0, 1,000]"),
    ("extra_scale=1e30", "extra_scale=1e+30 must be a finite number >= 0 and < 1000.0"),
])
def test_a_variant_options_lr_is_bounded_as_its_flag_is(option, says, capsys):
    """--matrix-lr 1e30 is refused; so is the same lr given as --variant-option, and a scale."""
    from scripts.train_args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--device-type", "cpu", "--variant-option", option])
    assert says in capsys.readouterr().err.strip().splitlines()[-1]


def test_fsdp_is_refused_for_a_stage_a_role_runs_that_shards_cannot(capsys):
    """A role's own apply stage is checked as the variant's is: one line naming the role's group,
    not a traceback on every rank once the model is sharded."""
    from scripts.train_args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--dataset", "embedded", "--device-type", "cpu", "--depth", "2", "--fsdp",
                    "--optimizer", "muon", "--variant-option", "roles.mlp.fc.apply=hyperball"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert ("--optimizer muon (its group 'matrices, mlp.fc'): apply 'hyperball' reads whole "
            "weight matrices") in line and line.endswith("drop --fsdp"), line
