"""scripts/gpu_check.sh against hostile or careless input: arguments checked as what they are
before any arithmetic or step, --plan and --dry-run that never start a step, and a --prepare that
runs nothing of the nanochat checkout it copies (no hooks, fsmonitor or filters), copies regular
files only, keeps the earlier copy until the new one is whole, and escapes its commit."""

import os
import re
import shlex
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def kit(tmp_path: Path) -> Path:
    """A copy of the script in a folder of its own (its kit is .gpu_check beside scripts/), and a
    bin/ whose `python` records each call and does nothing: no step can run for real."""
    # every step runs `python -m ...`; the import checks before them run `python -c` or `python -`
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "gpu_check.sh", tmp_path / "scripts")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    python = bin_ / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/python-calls\nexit 0\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def gpu_check(root: Path, *args, **env) -> subprocess.CompletedProcess:
    path = f"{root / 'bin'}:{os.environ['PATH']}"
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=root, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PATH": path, **env})


@pytest.mark.parametrize("minutes", ["1e3", "PIECE[$(touch PWNED)]", "0", "-1", "abc", "",
                                     "12345", "5.5"])
def test_a_budget_that_is_not_whole_minutes_is_refused_before_anything(tmp_path, minutes):
    """Every --budget-min that is not 1-9999 whole minutes: exit 2 and one line naming it, no
    command run (the subscript's command substitution included), nothing started."""
    root = kit(tmp_path)
    for mode in ("--plan", "--dry-run", None):
        p = gpu_check(root, *([mode] if mode else []), "--budget-min", minutes)
        assert p.returncode == 2 and p.stdout == "", (mode, p.stdout)
        assert p.stderr.count("\n") == 1 and "--budget-min takes whole minutes" in p.stderr
    assert not (root / "PWNED").exists() and not (root / "python-calls").exists()


def modules_run(root: Path) -> str:
    calls = root / "python-calls"
    return calls.read_text() if calls.exists() else ""


def test_a_leading_zero_is_a_number_and_the_plan_starts_nothing(tmp_path):
    """08 minutes is 8 (not bash's octal error); --plan prints the plan and starts no step."""
    root = kit(tmp_path)
    p = gpu_check(root, "--plan", "--budget-min", "08")
    assert p.returncode == 0 and "gpu_check plan: 8 min of device time" in p.stdout, p.stderr
    assert "-m " not in modules_run(root)


@pytest.mark.parametrize("only", [".*", "h2h.*", "h2h,", ",tests", "tests;true", "H2H", "d12"])
def test_only_takes_step_names_exactly_or_by_prefix(tmp_path, only):
    """--only is names, not patterns: a regex, an empty name, a name that is no step and no
    prefix before a _ of one: refused in one line."""
    p = gpu_check(kit(tmp_path), "--plan", "--only", only)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1, p.stderr
    assert "--only" in p.stderr


def test_only_by_name_and_by_prefix(tmp_path):
    root = kit(tmp_path)
    steps = lambda out: [name for name, *_ in plan_steps(out)]  # noqa: E731
    assert steps(gpu_check(root, "--plan", "--only", "h2h").stdout) == [
        "h2h_d24_fp8", "h2h_d24_bf16", "h2h_d12"]
    assert steps(gpu_check(root, "--plan", "--only", "tests,bench_optim_d20").stdout) == [
        "tests", "bench_optim_d20"]


@pytest.mark.parametrize("modes", [("--plan", "--prepare"), ("--dry-run", "--plan"),
                                   ("--prepare", "--dry-run")])
def test_modes_go_alone(tmp_path, modes):
    """Two of --prepare, --plan and --dry-run: refused, neither runs."""
    root = kit(tmp_path)
    p = gpu_check(root, *modes)
    assert p.returncode == 2 and "go alone" in p.stderr and p.stdout == ""
    assert not (root / "python-calls").exists()


def git(cwd: Path, *args) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


def hostile_checkout(root: Path) -> Path:
    """A nanochat checkout whose git config runs commands: fsmonitor, a hook, a clean filter and
    an external diff, each touching a file in root if it ever runs; and a FIFO among its .py."""
    src = root / "evil"
    (src / "nanochat").mkdir(parents=True)
    (src / "nanochat" / "gpt.py").write_text("class GPT: pass\nclass GPTConfig: pass\n")
    (src / "LICENSE").write_text("MIT\n")
    git(src, "init", "-q")
    git(src, "add", ".")
    git(src, "commit", "-q", "-m", "one")
    for key, value in (("core.fsmonitor", f"touch {root}/PWNED-fsmonitor; false"),
                       ("filter.evil.clean", f"touch {root}/PWNED-filter; cat"),
                       ("diff.external", f"touch {root}/PWNED-diff")):
        git(src, "config", key, value)
    (src / ".gitattributes").write_text("*.py filter=evil\n")
    hook = src / ".git" / "hooks" / "post-checkout"
    hook.write_text(f"#!/bin/sh\ntouch {root}/PWNED-hook\n")
    hook.chmod(0o755)
    os.mkfifo(src / "nanochat" / "fifo.py")
    return src


def test_prepare_runs_nothing_of_the_checkout_and_copies_regular_files(tmp_path):
    """--prepare on a hostile checkout: none of its commands run, the FIFO is left behind (no
    hang), gpt.py and the license are copied, and the commit is git's HEAD; an edited gpt.py then
    makes it HEAD+changes, still without running anything."""
    root = kit(tmp_path)
    src = hostile_checkout(root)
    head = git(src, "rev-parse", "HEAD")
    p = gpu_check(root, "--prepare", NANOCHAT=str(src))
    assert p.returncode == 0, p.stdout + p.stderr
    copy = root / ".gpu_check" / "nanochat"
    assert sorted(f.name for f in (copy / "nanochat").iterdir()) == ["gpt.py"]
    assert (copy / "LICENSE").is_file() and (copy / "COMMIT").read_text().strip() == head
    (src / "nanochat" / "gpt.py").write_text("class GPT: pass\nclass GPTConfig: pass\n# edit\n")
    assert gpu_check(root, "--prepare", NANOCHAT=str(src)).returncode == 0
    assert (copy / "COMMIT").read_text().strip() == head + "+changes"
    assert not list(root.glob("PWNED*")), list(root.glob("PWNED*"))


def test_a_failed_prepare_keeps_the_earlier_copy_and_the_commit_is_escaped(tmp_path):
    """A COMMIT file's escape sequences never reach the kit or the terminal; a checkout whose
    gpt.py is a link is refused in one line, and the copy made before stays whole."""
    root = kit(tmp_path)
    src = root / "plain"
    (src / "nanochat").mkdir(parents=True)
    (src / "nanochat" / "gpt.py").write_text("class GPT: pass\nclass GPTConfig: pass\n")
    (src / "COMMIT").write_bytes(b"\x1b[31mabc123\x07\n\x1b]0;title\x07")
    p = gpu_check(root, "--prepare", NANOCHAT=str(src))
    assert p.returncode == 0 and "\x1b" not in p.stdout + p.stderr, p.stderr
    commit = (root / ".gpu_check" / "nanochat" / "COMMIT").read_text().strip()
    assert commit == "31mabc1230title", commit
    bad = root / "linked"
    (bad / "nanochat").mkdir(parents=True)
    (bad / "nanochat" / "gpt.py").symlink_to(src / "nanochat" / "gpt.py")
    p = gpu_check(root, "--prepare", NANOCHAT=str(bad))
    assert p.returncode != 0 and "holds no nanochat/gpt.py" in p.stderr, p.stderr
    assert (root / ".gpu_check" / "nanochat" / "nanochat" / "gpt.py").is_file()
    assert (root / ".gpu_check" / "nanochat" / "COMMIT").read_text().strip() == commit


def test_bench_nanochat_reads_a_commit_as_plain_text_and_runs_no_git_hook(tmp_path):
    """bench_nanochat's commit_of: a COMMIT file's escapes removed; on a hostile checkout git runs
    none of its commands, and an edit shows as +changes."""
    from scripts.bench_nanochat import commit_of

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "COMMIT").write_bytes(b"\x1b[2Jdeadbeef\n")
    assert commit_of(plain) == "2Jdeadbeef"
    src = hostile_checkout(tmp_path)
    os.unlink(src / "nanochat" / "fifo.py")
    head = git(src, "rev-parse", "HEAD")
    assert commit_of(src) == head
    (src / "nanochat" / "gpt.py").write_text("# edited\n")
    assert commit_of(src) == head + "+changes"
    assert not list(tmp_path.glob("PWNED*")), list(tmp_path.glob("PWNED*"))


# a step of --plan: name, limit, whether its seconds were seen or are an estimate, its seconds,
# its command
PLAN_STEP = re.compile(r"^  (\S+)\s+(\d+)s  \((seen|est\.)\s+(\d+) s\)  (.*)$")


def plan_steps(out: str) -> list[tuple[str, ...]]:
    return [m.groups() for m in map(PLAN_STEP.match, out.splitlines()) if m]
# the techniques whose published signs the regime table checks (docs/research.md; track 3)
TECHNIQUES = {"adamw", "muon-soap", "muon-uw-floor", "muon-hyperball", "muon-powercool", "muon-contra",
              "muon-muown", "muon-newton"}


def ablate_flags(cmd: str) -> dict:
    """The flags of the scripts.ablate call in a step's command, by name."""
    words = shlex.split(cmd.split("-m scripts.ablate", 1)[1].split(";")[0])
    return {w: v for w, v in zip(words, words[1:]) if w.startswith("--")}


def test_the_regime_table_is_a_kit_step_the_plan_sizes(tmp_path):
    """The published-regime table: steps that run ablate's --preset regime on CUDA with >= 16 seeds,
    batched, each one technique against muon at lr-multiplier 0.5, 1 and 2 (the runs of --published,
    which every CPU runs the same), then --published itself, which reads them; each fits one command (the
    plan's 540 s). Planned to the default 15 minutes they are over the budget, and the plan says what they
    need: the machine's start and their seen seconds, in whole minutes, over 15."""
    root = kit(tmp_path)
    out = gpu_check(root, "--plan", "--only", "regime").stdout
    steps = plan_steps(out)
    assert steps and all(name.startswith("regime_") for name, *_ in steps), out
    swept, common = set(), set()
    for name, limit, _, seen, cmd in steps:
        flags = ablate_flags(cmd)
        assert flags["--preset"] == "regime" and flags["--device-type"] == "cuda", (name, flags)
        assert int(flags["--seeds"]) >= 16 and "--no-batch-seeds" not in cmd, name
        assert int(seen) <= int(limit) <= 540, name
        common.add(tuple((k, v) for k, v in flags.items()
                         if k not in ("--name", "--variants", "--baseline", "--sweep", "--published")))
        if name == "regime_table":
            words = shlex.split(cmd.split("-m scripts.ablate", 1)[1].split(";")[0])
            assert "--published" in words and not {"--variants", "--sweep"} & set(flags), cmd
            continue
        variant, sweep = flags["--sweep"].split(":")
        assert sweep == "lr-multiplier=0.5,1,2" and flags["--variants"] == f"muon,{variant}", cmd
        assert flags["--baseline"] == "muon", name
        swept.add(variant)
    assert swept == TECHNIQUES and steps[-1][0] == "regime_table", (swept, steps)
    assert len(common) == 1, common  # the same flags: the steps' runs are the table's
    start = int(re.search(r"the first starts the machine: about (\d+) s", out)[1])
    need = start + sum(int(seen) for _, _, _, seen, _ in steps)
    minutes = -(-need // 60)
    assert f"need about {minutes} min of device time ({need} s" in out and minutes > 15, out
    whole = gpu_check(root, "--plan").stdout
    over = " ".join(line for line in whole.splitlines() if line.startswith("  over the budget"))
    assert all(name in over for name, *_ in steps), whole


def test_prepare_makes_the_regime_presets_tokenizer(tmp_path):
    """--prepare trains the preset's 320-token vocab on the CPU machine (the GPU may lack rustbpe);
    a first one makes the kit's folder itself (the fake python makes none of it)."""
    root = kit(tmp_path)
    assert not (root / ".gpu_check").exists()
    p = gpu_check(root, "--prepare")
    assert p.returncode == 0 and (root / ".gpu_check" / "commit").is_file(), p.stderr
    assert "-m scripts.tok_train --keep-existing --dataset embedded --vocab-size 320" in modules_run(root)


def test_prepare_takes_a_downloaded_nanochat_as_an_unknown_commit(tmp_path):
    """A nanochat folder with neither a COMMIT file nor .git (a downloaded zip): --prepare copies
    it, records its commit as unknown and says so, and ends well (rc 0)."""
    root = kit(tmp_path)
    src = tmp_path / "zip" / "nanochat-master"
    (src / "nanochat").mkdir(parents=True)
    (src / "nanochat" / "gpt.py").write_text("class GPT: pass\nclass GPTConfig: pass\n")
    p = gpu_check(root, "--prepare", NANOCHAT=str(src))
    assert p.returncode == 0, p.stdout + p.stderr
    copy = root / ".gpu_check" / "nanochat"
    assert (copy / "COMMIT").read_text().strip() == "unknown"
    assert (copy / "nanochat" / "gpt.py").is_file()
    assert "nanochat: unknown commit (no COMMIT file, not a git checkout)" in p.stdout, p.stdout


def test_prepare_refuses_a_wrong_nanochat_before_any_work(tmp_path):
    """NANOCHAT naming no checkout: one line on stderr before the tokenizers or anything else
    runs."""
    root = kit(tmp_path)
    p = gpu_check(root, "--prepare", NANOCHAT=str(tmp_path / "nosuch"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "holds no nanochat/gpt.py" in p.stderr and "-m " not in modules_run(root)


def test_the_default_15_minutes_go_to_the_speedruns_model_against_nanochat_first(tmp_path):
    """The default plan, most valuable first: the d24 head to head with nanochat in fp8 (as its
    1.65-hour run), then bf16, then ablate, then the CUDA tests and d12. Both d24 steps are calls
    within the 15 minutes, counting the machine's start and their seconds. Steps never run on the
    speedrun's model say their seconds are estimates."""
    out = gpu_check(kit(tmp_path), "--plan").stdout
    steps = plan_steps(out)
    assert [name for name, *_ in steps[:5]] == [
        "h2h_d24_fp8", "h2h_d24_bf16", "ablate", "tests", "base_train_d12"], out
    for name, *_, cmd in steps[:2]:
        words = shlex.split(cmd.split("python -m scripts.bench_nanochat", 1)[1])
        flags = dict(zip(words, words[1:]))
        assert flags["--depth"] == "24" and flags["--precision"] == name.rsplit("_", 1)[1], cmd
        assert flags["--attention"] == "auto" and flags["--nanochat"].endswith("nanochat"), cmd
        assert (flags["--max-seq-len"], flags["--device-batch-size"]) == ("2048", "16"), cmd
    basis = {name: b for name, _, b, _, _ in steps}
    never_ran = [n for n in basis if n.startswith(("h2h", "base_train", "fp8", "ablate", "regime"))
                 or n in ("tests", "speedrun")]
    assert all(basis[n] == "est." for n in never_ran), basis
    assert "est.: an estimate, never yet run on the speedrun's model" in out, out
    calls = re.findall(r"^  call \d+: .* --only (\S+)$", out, re.M)
    assert calls[:2] == ["h2h_d24_fp8", "h2h_d24_bf16"], out
    start = int(re.search(r"the first starts the machine: about (\d+) s", out)[1])
    seconds = {name: int(s) for name, _, _, s, _ in steps}
    assert start + sum(seconds[c] for c in ",".join(calls).split(",")) <= 15 * 60, out


def fake_gpu_python(root: Path) -> None:
    """A `python` for the kit's run on no GPU: it records each call; bench_nanochat prints what a
    d24 fp8 head to head prints (its attention, summary and estimate), ablate runs out of memory,
    every other call ends well."""
    (root / "bin" / "python").write_text(f"""#!/bin/sh
echo "$@" >> {root}/python-calls
case "$*" in
*scripts.bench_nanochat*)
    echo "attention: nanomuon flex, nanochat sdpa with windows as a mask"
    echo "h2h d24 fp8: nanomuon 400,000 tok/s; nanochat 420,000 tok/s"
    echo "time to GPT-2 on 8xH100 = 1.73 h (the ratio of this run)" ;;
*scripts.ablate*)
    echo "Traceback (most recent call last):"
    echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    echo "[rank0]: the process ended"
    exit 1 ;;
esac
""")
    (root / ".gpu_check" / "base" / "tokenizer").mkdir(parents=True)
    (root / ".gpu_check" / "base" / "tokenizer" / "tokenizer.json").write_text("{}")
    (root / ".gpu_check" / "base" / "data" / "embedded").mkdir(parents=True)


def test_a_failed_step_says_why_the_rest_run_and_the_estimate_heads_the_summary(tmp_path):
    """A run of three steps: the head to head's line names each side's attention and its time
    to GPT-2 stands in the summary in bold and ends the output; the ablate that runs out of memory
    reads FAILED with its exit and the error's own line; the tests after it still run."""
    root = kit(tmp_path)
    fake_gpu_python(root)
    p = gpu_check(root, "--only", "h2h_d24_fp8,ablate,tests")
    assert p.returncode == 0, p.stdout + p.stderr
    summary = (root / ".gpu_check.md").read_text()
    h2h = re.search(r"^## h2h_d24_fp8: ok, \d+ s; attention: (.*)$", summary, re.M)
    assert h2h and h2h[1] == "nanomuon flex, nanochat sdpa with windows as a mask", summary
    assert "\n**time to GPT-2 on 8xH100 = 1.73 h (the ratio of this run)**\n" in summary
    assert re.search(r"^## ablate: FAILED \(exit 1\): torch.OutOfMemoryError: CUDA out of memory. "
                     r"Tried to allocate 2.00 GiB, \d+ s$", summary, re.M), summary
    assert re.search(r"^## tests: ok, \d+ s$", summary, re.M), summary
    assert "-m pytest -q --slow -m cuda tests" in modules_run(root)
    assert p.stdout.splitlines()[-1] == "time to GPT-2 on 8xH100 = 1.73 h (the ratio of this run)"


@pytest.mark.heavy
def test_the_dry_run_parses_each_steps_command_with_the_modules_own_parser(tmp_path):
    """--dry-run fails in one line a step whose command names a module that does not exist or a
    flag its module does not take: by the script's own parse_args (bench_nanochat), else by the
    flags its --help names (bench_optim)."""
    root = tmp_path / "kit"
    (root / "scripts").mkdir(parents=True)
    text = (REPO / "scripts" / "gpu_check.sh").read_text()
    for old, new in (("--warmup 2 --attention auto", "--warmpu 2 --attention auto"),
                     ("defaults --ns-precision fp16", "defaults --ns-prec fp16"),
                     ("-m nanomuon.dataset --embedded \\\n&& NANOMUON_BASE",
                      "-m nanomuon.datasets --embedded \\\n&& NANOMUON_BASE")):
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (root / "scripts" / "gpu_check.sh").write_text(text)
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--only",
                        "h2h_d24_fp8,ablate,bench_optim_d20"], cwd=root, capture_output=True,
                       text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stderr.splitlines() == [
        "error: step h2h_d24_fp8: python -m scripts.bench_nanochat: unrecognized arguments: "
        "--warmpu 2",
        "error: step ablate: python -m nanomuon.datasets: there is no such module",
        "error: step bench_optim_d20: python -m scripts.bench_optim: its --help names no "
        "--ns-prec"], p.stderr


@pytest.mark.heavy
def test_every_step_of_the_plan_names_real_modules_and_flags():
    """The real plan's --dry-run: each step's python -m calls parse with their modules' own
    parsers (speedrun.sh's flags with base_train's), and the steps' modules are all checked."""
    p = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and p.stderr == "", p.stdout[-2000:] + p.stderr[-2000:]
    checked = set(re.findall(r"^(\S+) flags: ok \(\d+ of the steps' calls\)$", p.stdout, re.M))
    assert checked == {"scripts.bench_nanochat", "pip", "nanomuon.dataset", "scripts.ablate",
                       "pytest", "scripts.base_train", "scripts.bench_optim"}, p.stdout
