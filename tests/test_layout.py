"""
The layout claims of the README, checked on the source: no import cycles between nanomuon modules
(imports inside functions count), each library file imports only files above it in the README's
layout, the update (muon.py) imports only torch, sharded.py and owners.py never reach
optim.py, the model file imports no baseline, the plumbing (common.py) imports nothing from the
optimizer, the recipe imports no other module, every file says why it exists, no function runs over
80 lines, muon.py and optim.py keep their code budgets (comments uncounted), lines read at 100
columns, no comment cites an issue number, and every script prints its --help.
"""

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = sorted((ROOT / "nanomuon").rglob("*.py"))  # the research wing, nanomuon/ablation/, too
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


def imports(path: Path) -> set[str]:
    """Every module path imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from nanomuon import x` imports a module
    return out


def module_name(p: Path) -> str:
    """A library file's module under nanomuon: 'optim', 'ablation.runs', 'ablation.__init__'."""
    rel = p.relative_to(ROOT / "nanomuon") if ROOT / "nanomuon" in p.parents else Path(p.name)
    return ".".join(rel.with_suffix("").parts)


def library_graph() -> dict[str, set[str]]:
    names = {module_name(p) for p in LIBRARY}
    graph = {}
    for p in LIBRARY:
        paths = {m.removeprefix("nanomuon.") for m in imports(p) if m.startswith("nanomuon.")}
        deps = {n for n in names for m in paths if m == n or m.startswith(n + ".")}
        graph[module_name(p)] = deps - {module_name(p)}
    return graph


def reaches(graph: dict[str, set[str]], m: str, seen=()) -> set[str]:
    """Every module m imports, directly or through others."""
    return set(graph[m]) | {x for d in graph[m] if d not in seen for x in reaches(graph, d, (*seen, m))}


def test_no_import_cycles_lazy_imports_included():
    graph = library_graph()
    done, on_path = set(), []

    def visit(m):
        if m in on_path:
            raise AssertionError("import cycle: " + " -> ".join(on_path[on_path.index(m):] + [m]))
        if m in done:
            return
        on_path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        on_path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_the_cycle_check_sees_lazy_imports(tmp_path, monkeypatch):
    """The check above must fail on a cycle closed by an import inside a function."""
    (tmp_path / "a.py").write_text('"""a"""\nimport nanomuon.b\n')
    (tmp_path / "b.py").write_text('"""b"""\ndef f():\n    from nanomuon.a import x\n')
    monkeypatch.setattr(sys.modules[__name__], "LIBRARY", [tmp_path / "a.py", tmp_path / "b.py"])
    with pytest.raises(AssertionError, match="import cycle"):
        test_no_import_cycles_lazy_imports_included()


def test_the_update_and_the_owners_stand_alone():
    """muon.py, the update a step runs, imports nothing of nanomuon; coefficients.py nothing at all
    but the standard library; owners.py only muon.py; the optimizer's files never reach optim.py."""
    stdlib = {"typing", "collections", "contextlib", "functools", "math"}
    assert {m.split(".")[0] for m in imports(ROOT / "nanomuon" / "muon.py")} <= {"torch", *stdlib}
    assert {m.split(".")[0] for m in imports(ROOT / "nanomuon" / "coefficients.py")} <= stdlib
    assert {m.split(".")[0] for m in imports(ROOT / "nanomuon" / "hardware.py")} <= {"torch",
                                                                                    "functools"}
    assert {m.split(".")[1] for m in imports(ROOT / "nanomuon" / "owners.py")
            if m.startswith("nanomuon")} <= {"muon"}
    graph = library_graph()

    for module in ("sharded", "owners", "muon", "stages", "coefficients", "kinds", "param_groups"):
        assert "optim" not in reaches(graph, module), f"{module}.py depends on optim.py"
    assert "baselines" not in reaches(graph, "gpt"), "the model file imports an optimizer baseline"


OPTIMIZER = {"optim", "muon", "stages", "coefficients", "kinds", "sharded", "owners", "param_groups",
             "baselines", "variants", "reference"}


def test_the_plumbing_imports_nothing_from_the_optimizer():
    """common.py sits below the optimizer: what both need (the bf16 rule) lives in hardware.py."""

    found = reaches(library_graph(), "common") & OPTIMIZER
    assert not found, f"common.py reaches {found}"


def test_the_recipe_imports_no_model_and_no_optimizer():
    """recipe.py is pure functions of sizes and token counts, which gpt.py reads for its default lrs."""
    assert not library_graph()["recipe"], library_graph()["recipe"]


def test_each_library_file_imports_only_files_above_it_in_the_readme():
    """The README's layout lists the library bottom up: a reader meets no name before its file."""
    listed = [m.replace("/", ".") for m in re.findall(r"^nanomuon/([\w/]+)\.py ",
                                                       (ROOT / "README.md").read_text(), re.MULTILINE)]
    graph = library_graph()
    files = {m for m in graph if not m.endswith("__init__")}
    assert set(listed) == files, files ^ set(listed)
    late = {m: sorted(d for d in graph[m] if listed.index(d) > listed.index(m)) for m in listed}
    assert not any(late.values()), {m: d for m, d in late.items() if d}


def test_every_file_says_why_it_exists():
    for p in LIBRARY + SCRIPTS + sorted((ROOT / "tests").glob("*.py")):
        if p.name == "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(p.read_text()))
        assert doc and len(doc.split()) >= 5, f"{p.relative_to(ROOT)} opens without a docstring"


def functions(path: Path):
    """(name, lines) of every function and method in path."""
    tree = ast.parse(path.read_text())
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def code_lines(source: str) -> set[int]:
    """The numbers of source's code lines: not blank, not comment-only, not a docstring's (a
    module's, class's or function's first string). Comments and docstrings count in no limit."""
    docs = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docs.update(range(first.lineno, first.end_lineno + 1))
    prose = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENDMARKER}
    return {line for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type not in prose for line in range(t.start[0], t.end[0] + 1)} - docs


def test_the_code_count_skips_comments_and_docstrings():
    source = ('"""A\ndocstring."""\n\n# a comment\nx = 1  # why\ndef f(a,  # a\'s shape\n'
              '      b):\n    """Doc."""\n\n    return """not a\ndocstring"""\n')
    assert sorted(code_lines(source)) == [5, 6, 7, 10, 11]


# The code lines the update and the optimizer may hold: what their old caps on raw lines (muon.py
# 450, optim.py 750) left for code. muon.py's 12 more carry muon_update's and adamw_update's
# arguments one a line, each with its shape, and read a Tensor lr as a number. optim.py's 24 more
# run the kinds of kinds.py by their declared state, and its 72 more keep torch.optim's contract
# (copies, load hooks first, the cast, other code's group keys, named params). Comments and
# docstrings count in no limit: a reason beside a line costs nothing.
CODE_BUDGET = {"nanomuon/muon.py": 323, "nanomuon/optim.py": 673}


def test_the_update_and_the_optimizer_keep_their_code_budgets():
    found = {f: len(code_lines((ROOT / f).read_text())) for f in CODE_BUDGET}
    over = {f: f"{n} > {CODE_BUDGET[f]}" for f, n in found.items() if n > CODE_BUDGET[f]}
    assert not over, f"code lines over budget (comments and docstrings uncounted): {over}"


def test_functions_stay_short():
    """No function of the library or the scripts runs over 80 lines: size follows from clarity."""
    long = {f"{p.relative_to(ROOT)}:{name}": n for p in LIBRARY + SCRIPTS for name, n in functions(p) if n > 80}
    assert not long, f"functions over 80 lines: {long}"


def test_lines_read_at_100_columns():
    """At most 8% of the library's and the scripts' lines run past 100 characters (ruff's hard cap is 120)."""
    lines = [line for p in LIBRARY + SCRIPTS for line in p.read_text().splitlines()]
    long = sum(len(line) > 100 for line in lines)
    assert long <= 0.08 * len(lines), f"{long} of {len(lines)} lines are over 100 characters"


def test_comments_cite_no_issue_numbers():
    """Comments and docstrings say what and why; the history of a line is git's to tell."""
    cited = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    found = [f"{p.relative_to(ROOT)}:{i}" for p in LIBRARY + SCRIPTS + sorted((ROOT / "tests").glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if cited.search(line)]
    assert not found, f"issue numbers cited at {found}"


def test_every_script_prints_its_help():
    """`python -m scripts.X --help` prints the usage and exits 0 for every script: argparse formats
    help strings with %, so a literal one (a share in a preset's description, say) would crash it."""
    import contextlib
    import importlib
    import io

    for path in SCRIPTS:
        if path.stem == "__init__" or "argparse" not in path.read_text() \
                or "__main__" not in path.read_text():  # train_args: base_train's flags, no script
            continue
        module = importlib.import_module(f"scripts.{path.stem}")
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
            module.main(["--help"])
        assert e.value.code == 0 and "usage:" in out.getvalue(), path.stem


# What a reader opens to follow one pass of the training loop: the loop, the loader, the model,
# the arch's lr, momentum and decay schedules, the optimizer and the update math, and the print of
# the step's line (on one process and under torchrun alike). The groups' convention and checks
# (param_groups.py) run when a group is resolved, not at every step.
STEP_FILES = {"scripts/base_train.py", "nanomuon/dataloader.py", "nanomuon/gpt.py",
              "nanomuon/arch.py", "nanomuon/optim.py", "nanomuon/muon.py", "nanomuon/common.py"}


def calls_run(fn):
    """fn()'s result, and the library and script functions it ran on this thread: (file, name,
    first line) of each, its file relative to the repository."""
    seen, before = set(), sys.gettrace()

    def tracer(frame, event, arg):  # call events only: no line tracing
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(ROOT) and path.parent.name in ("nanomuon", "scripts"):
            code = frame.f_code
            seen.add((path.relative_to(ROOT).as_posix(), code.co_name, code.co_firstlineno))

    sys.settrace(tracer)
    try:
        return fn(), seen
    finally:
        sys.settrace(before)


def files_run(fn):
    """fn()'s result and the library and script files whose functions it ran (on this thread)."""
    out, calls = calls_run(fn)
    return out, {f for f, _, _ in calls}


def test_a_pass_of_the_training_loop_reads_in_seven_files(base, monkeypatch):
    """A pass of base_train's loop (train_step and record_step, past the first two steps, which
    compile and warm up) runs code of STEP_FILES only: no plumbing, hardware facts, attention
    choice, group checks or DTensor path on the way, and at most 62 functions of them."""
    from test_train import TINY

    import scripts.base_train as bt

    real_train, real_record, found = bt.train_step, bt.record_step, []

    def train(run):  # step 2 runs under the trace, inside record() below
        return None if run.step == 2 else real_train(run)

    def record(run, s, warm):  # the loop's line: record_step(run, train_step(run), warm)
        if s is not None:
            return real_record(run, s, warm)
        found.append(calls_run(lambda: real_record(run, real_train(run), warm))[1])

    monkeypatch.setattr(bt, "train_step", train)
    monkeypatch.setattr(bt, "record_step", record)
    bt.main([*TINY, "--total-batch-size", "256", "--num-iterations", "3", "--eval-every", "-1",
             "--run", "step-files"])
    assert len(found) == 1, found
    files = {f for f, _, _ in found[0]}
    assert {"nanomuon/gpt.py", "nanomuon/common.py"} <= files, files
    assert files <= STEP_FILES, f"a pass also runs {sorted(files - STEP_FILES)}"
    named = sorted((f, n) for f, n, _ in found[0] if not n.startswith("<"))
    assert len(named) <= 62, named


def test_a_model_and_optimizer_step_reads_in_40_functions():
    """Step 2 of a tiny GPT's forward, backward and optimizer step, as a reader follows it: at most
    40 named functions of the library, 535 code lines between them (comments and docstrings
    uncounted: nanochat's are 17 functions and 478 lines with theirs). A group resolved anew at
    every step, or a derivation per call, would pass both bounds."""
    import ast

    from nanomuon.gpt import GPT, config_from_depth
    from nanomuon.recipe import peak_lrs

    torch.manual_seed(0)
    model = GPT(config_from_depth(2, 97, 64, aspect_ratio=32, head_dim=32))
    model.init_weights()
    opt = model.setup_optimizer(lrs=peak_lrs(512))
    x = torch.randint(0, 97, (4, 64))

    def step():
        model(x, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for _ in range(2):
        step()
    _, calls = calls_run(step)
    named = {c for c in calls if not c[1].startswith("<")}
    sizes = {}
    for f in {f for f, _, _ in named}:
        source = (ROOT / f).read_text()
        code = code_lines(source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                size = len(code & set(range(node.lineno, node.end_lineno + 1)))
                sizes[(f, node.name, node.lineno)] = sizes[(f, node.name, first)] = size
    lines = sum(sizes[c] for c in named)
    assert len(named) <= 40 and lines <= 535, (len(named), lines, sorted(named))


def _dist_step_worker(rank, world_size):
    from nanomuon.gpt import GPT, config_from_depth
    from nanomuon.optim import DistMuonAdamW

    model = GPT(config_from_depth(2, 97, 16, aspect_ratio=64, head_dim=32))
    model.init_weights()
    optimizer = model.setup_optimizer()
    assert isinstance(optimizer, DistMuonAdamW)
    for step in range(3):
        x = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(rank * 10 + step))
        model(x[:, :-1], x[:, 1:]).backward()
        _, seen = files_run(optimizer.step)
        optimizer.zero_grad(set_to_none=True)
    assert seen <= {"nanomuon/optim.py", "nanomuon/param_groups.py", "nanomuon/muon.py"}, seen


def test_a_data_parallel_step_reads_no_more_files():
    """DistMuonAdamW's step at world 2 stays in optim, param_groups and muon: the owners are
    assigned once and kept, AdamW's shard cut is optim's own."""
    from test_dist import spawn

    spawn(_dist_step_worker, 2)
