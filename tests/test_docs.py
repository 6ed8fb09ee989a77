"""
The docs, checked against the tree they describe: every relative link (and #anchor) in README.md
and docs/*.md resolves, the tables of group keys in docs/optimizer.md are the ones stages declares, and
every module.name the docs, docstrings and comments cite exists. The README keeps its shape (at
most 250 lines, its sections in order, the test command CI reads, a link to every docs page). No
page cites an internal issue number, and prose keeps nanochat's pace. Docs drift silently
otherwise: a renamed file or option leaves a dead link or a wrong table that no other test reads.
"""
import ast
import importlib
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# An internal issue is cited as the word issue and its number, or as # and the number. An
# owner/repo#N reference is a link a reader can follow; a table's # and one digit is a row number.
CITED = re.compile(r"\bissues? #?\d+|(?<![\w/.-])#\d{2,}\b", re.IGNORECASE)


def prose(text: str) -> str:
    """text without fenced code blocks and inline code, where brackets are code, not links."""
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (but - and _), spaces as -."""
    heading = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page, with GitHub's -1, -2 suffixes for repeats."""
    seen, out = {}, set()
    for line in prose(page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def links(page: Path) -> list[str]:
    return [t for t in LINK.findall(prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not ours


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_the_link_check_sees_a_broken_link(tmp_path):
    """The check above must catch a missing file and a missing heading, and skip code."""
    (tmp_path / "a.md").write_text("# Title\n\n## Two words\n")
    page = tmp_path / "p.md"
    page.write_text("[ok](a.md#two-words) [gone](b.md) [no](a.md#nope) `[code](x.md)`\n"
                    "```\n[block](y.md)\n```\n[web](https://example.com/z.md)\n")
    assert links(page) == ["a.md#two-words", "b.md", "a.md#nope"]
    assert anchors(tmp_path / "a.md") == {"title", "two-words"}


def test_the_option_table_is_the_declared_one():
    """docs/optimizer.md's table of optional muon keys is stages.options_table(), made from
    MUON_OPTIONS: a key declared, renamed or re-described there changes the table, and this fails
    until the page follows (`python -c "from nanomuon.stages import options_table;
    print(options_table())"` prints it)."""
    from nanomuon.stages import MUON_OPTIONS, options_table

    page = (ROOT / "docs" / "optimizer.md").read_text()
    start = page.index("<!-- muon-options")
    table = page[page.index("\n", start) + 1:page.index("<!-- /muon-options -->")].strip()
    assert table == options_table()
    assert [line.split("`")[1] for line in table.splitlines()[2:]] == list(MUON_OPTIONS)


def test_the_group_keys_table_is_the_declared_one():
    """docs/optimizer.md's table of each kind's own keys is stages.keys_table(), made from
    GROUP_KEYS: a row added, or a fact of one changed, fails this until the page follows."""
    from nanomuon.stages import GROUP_KEYS, keys_table

    page = (ROOT / "docs" / "optimizer.md").read_text()
    start = page.index("<!-- group-keys")
    table = page[page.index("\n", start) + 1:page.index("<!-- /group-keys -->")].strip()
    assert table == keys_table()
    listed = {line.split("`")[1] for line in table.splitlines()[2:]}
    assert listed == {k for keys in GROUP_KEYS.values() for k in keys}


def test_each_kinds_table_is_the_declared_one():
    """Each built-in kind of kinds.KINDS has its key table in docs/optimizer.md, as
    kinds.options_table(kind) makes it from the entry's Option rows."""
    from nanomuon.kinds import KINDS, options_table

    page = (ROOT / "docs" / "optimizer.md").read_text()
    for kind in KINDS:
        start = page.index(f"<!-- kind-options {kind}:")
        end = page.index("<!-- /kind-options -->", start)
        assert page[page.index("\n", start) + 1:end].strip() == options_table(kind), kind


def test_the_readme_keeps_its_shape():
    """A newcomer reads it in five minutes: at most 250 lines, the sections in this order, and a
    link to every docs page (the detail lives there)."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250, "README.md is over 250 lines: move detail to docs/"
    sections = re.findall(r"^## (.+)$", prose(text), flags=re.MULTILINE)
    assert sections == ["Quick start", "What you get", "The optimizer", "Trying an idea",
                        "Layout", "License"]
    linked = {Path(t.partition("#")[0]).name for t in links(README) if t.startswith("docs/")}
    assert linked >= {p.name for p in (ROOT / "docs").glob("*.md")}


def test_the_readme_holds_the_command_ci_runs():
    """.ci/run runs the line two below the marker (after the fence): it must be the pip install and
    the default suite, as the README promises."""
    lines = README.read_text().splitlines()
    i = lines.index("<!-- test-command -->")
    assert lines[i + 1] == "```bash"
    assert lines[i + 2].startswith("pip install torch==") and lines[i + 2].endswith("-m pytest")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_cites_an_issue_number(page):
    """Pages say what holds and why; which issue changed it is git's to tell."""
    found = [f"{i}: {m.group(0)}" for i, line in enumerate(page.read_text().splitlines(), 1)
             for m in CITED.finditer(line)]
    assert not found, f"{page.relative_to(ROOT)} cites issue numbers at lines {found}"


def test_the_license_is_the_declared_one():
    """pyproject.toml says MIT; the LICENSE file is what a reader (and a packager) looks for."""
    assert 'license = { text = "MIT" }' in (ROOT / "pyproject.toml").read_text()
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "the nanomuon authors" in text


def test_benchmarks_hold_current_numbers_only():
    """benchmarks.md stays short (about 200 lines): today's numbers; their history is log.md's."""
    assert len((ROOT / "docs" / "benchmarks.md").read_text().splitlines()) <= 220


# Prose is read at nanochat's pace. By this count its README (92d63d4) averages 16.5 words a
# sentence, and 4 of its 98 sentences run over 40 words (none of its 15 table rows do). A page may
# average 22, and no sentence or table row may run over 40: one that long is two.
SENTENCE_WORDS = 22
LONGEST = 40
ARCHIVE = ROOT / "docs" / "archive"  # history kept for the record, which no reader has to read
ABBREVIATIONS = re.compile(r"\b(e\.g|i\.e|et al|vs|cf|etc)\.", re.IGNORECASE)
PROSE_CELL = re.compile(r"[A-Za-z]{2}")  # a cell of numbers and units alone is data, not prose


def sentences(text: str, tables: bool = False) -> list[str]:
    """A page's prose as sentences, as a reader meets them: fenced code, headings, images and
    HTML comments are left out; every list item is a sentence (or more), labels included; a code
    span counts its words and a link its text; a paragraph or a list item ends a sentence, as does
    . ! or ? before a space. With tables, each table row is one too, read across its cells with
    words in them (a cell of numbers and units alone is data)."""
    text = re.sub(r"^ *```.*?^ *```[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)
    paragraphs, current = [], []
    for line in text.splitlines():
        s = line.strip()
        item = re.match(r"([-*+]|\d+\.)\s+(.*)", s)
        if not s or s.startswith(("#", "|", "![", "<")) or item:
            paragraphs.append(" ".join(current))
            current = [item.group(2)] if item else []
            if tables and s.startswith("|"):
                cells = (c.strip() for c in s.strip("|").split("|"))
                paragraphs.append(" ".join(c for c in cells if PROSE_CELL.search(c)))
        else:
            current.append(s)
    paragraphs.append(" ".join(current))
    out = []
    for p in paragraphs:
        p = re.sub(r"`([^`]*)`", r"\1", p)
        p = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", p)
        p = ABBREVIATIONS.sub(r"\1", p)
        out += [s for s in re.split(r"(?<=[.!?])[\"')\]*]*\s+", p) if words(s)]
    return out


def words(sentence: str) -> int:
    return sum(1 for w in sentence.split() if re.search(r"[A-Za-z0-9]", w))


def pace(page: Path) -> tuple[float, float]:
    """Words per sentence, and opening parentheses per 100 words, over a page's prose (a table's
    short rows would pad the average, so they count only toward the longest)."""
    found = sentences(page.read_text())
    n = sum(words(s) for s in found)
    return n / max(len(found), 1), 100 * sum(s.count("(") for s in found) / max(n, 1)


def test_the_sentence_count_reads_what_a_reader_reads():
    """A list item is a sentence even with no full stop (a label reads as one), a code span
    counts its words and a link its text; headings and code blocks are not prose. A table row
    is one sentence of its cells with words, when tables are asked for (the generated option
    table's too: its one-line meanings are read like any row)."""
    text = ("# A heading of many words that are not a sentence at all\n\n"
            "One two three. Four five `a long code span` six, e.g. seven.\n"
            "- an item.\n- [a link](x.md) here (aside)!\n- a label\n  that wraps\n"
            "1. a step\n\n| step | what | tok/s |\n|---|---|---:|\n"
            "| d12 | **570 tok/s**, 20 steps | 1,234 |\n| 0.02 / 0.04 | 2^19 |\n"
            "```\nnot. read.\n```\n<!-- a comment -->\n"
            "<!-- muon-options: made by code -->\n| `key` | the code's words |\n"
            "<!-- /muon-options -->\n")
    prose = ["One two three.", "Four five a long code span six, e.g seven.", "an item.",
             "a link here (aside)!", "a label that wraps", "a step"]
    assert sentences(text) == prose
    assert sentences(text, tables=True) == [*prose, "step what tok/s", "**570 tok/s**, 20 steps",
                                            "key the code's words"]
    assert [words(s) for s in sentences(text, tables=True)] == [3, 9, 2, 4, 4, 2, 3, 4, 4]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_sentences_are_short(page):
    """Prose sentences average at most SENTENCE_WORDS words on every page but the archive's, and
    none, nor any table row, runs over LONGEST."""
    length, parens = pace(page)
    print(f"{page.relative_to(ROOT)}: {length:.1f} words a sentence, {parens:.1f} ( per 100 words")
    assert length <= SENTENCE_WORDS, (
        f"{page.relative_to(ROOT)}: sentences average {length:.1f} words (at most "
        f"{SENTENCE_WORDS}): split the long ones")
    long = [f"{words(s)}: {s[:80]}..." for s in sentences(page.read_text(), tables=True)
            if words(s) > LONGEST]
    assert not long, f"{page.relative_to(ROOT)}: sentences over {LONGEST} words: {long}"


def measured(text: str) -> list[tuple[str, float, int]]:
    """Each number in text as written, its value and its decimals (570k is 570,000 to the
    thousand); commas are thousands."""
    out = []
    for m in re.finditer(r"(?<![\w.])(-?\d[\d,]*(?:\.(\d+))?)([kM]?)(?![\w-])", text):
        scale = {"k": 1e3, "M": 1e6}.get(m.group(3), 1)
        out.append((m.group(0), float(m.group(1).replace(",", "")) * scale,
                    len(m.group(2) or "") - {1e3: 3, 1e6: 6}.get(scale, 0)))
    return out


def evidence(page: str) -> list[str]:
    """A page cut where one measurement's numbers stay together: a paragraph or list item, or a
    table row with the paragraph that introduces its table."""
    out, intro, para = [], "", []
    for line in page.splitlines() + [""]:
        if line.startswith("|"):
            out.append(intro + " " + line)
            continue
        if line.strip() and not line.startswith(("#", "- ")):
            para.append(line)
            continue
        if para:
            intro = " ".join(para)
            out.append(intro)
        para = [line] if line.startswith("- ") else []
    return out


def test_the_readme_quotes_benchmarks():
    """Every number in the result column of the README's table of measured runs is one of
    benchmarks.md's, rounded as the README rounds it, and all of a row's numbers are in one
    paragraph or table row there (with the row's date on the page): the README quotes, and
    benchmarks.md is where a number changes."""
    text = README.read_text()
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    blocks = [[v for _, v, _ in measured(b)] for b in evidence(bench)]
    table = text[text.index("## What you get"):text.index("## The optimizer")]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in table.splitlines()[4:] if line.startswith("|")]
    wrong = []
    for row in rows:
        if not row[2]:
            continue  # not yet measured
        if row[2] not in bench:
            wrong.append(f"{row[0]}: date {row[2]}")
        quoted = measured(row[-1])
        if not any(all(any(round(v, d) == round(x, d) for v in values) for _, x, d in quoted)
                   for values in blocks):
            wrong.append(f"{row[0]}: {row[-1]}")
    assert rows and not wrong, f"README rows that docs/benchmarks.md does not hold: {wrong}"


def test_the_stages_table_lists_every_registered_stage():
    """docs/optimizer.md's Stages table names, per registry, every built-in entry and no other
    (`equilibrate_row`, `_col` is equilibrate_row and equilibrate_col)."""
    from nanomuon import stages

    page = (ROOT / "docs" / "optimizer.md").read_text()
    section = page[page.index("### Stages"):]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4 and cells[1].strip("`").isupper():
            names, prefix = set(), ""
            for span in re.findall(r"`([^`]+)`", cells[3]):
                if span.startswith("_"):
                    span = prefix + span
                prefix = span.split("_")[0]
                names.add(span)
            registry = getattr(stages, cells[1].strip("`"))
            assert names == set(registry), f"{cells[1]}: the table lists {sorted(names)}"


# a variant's name as the docs write it; `muon-mine` is research.md's example of one to add
VARIANT = re.compile(r"(?:muon|adamw|torch-muon|scion)(?:-[a-z0-9]+)*")
# names an example defines: README's own variant, research.md's Newton-Muon controls (an ideas file)
EXAMPLES = {"muon-mine", "muon-newton-control", "muon-newton-muon-lrs",
            "muon-newton-muon-lrs-control"}


def test_every_variant_the_docs_name_exists_and_the_list_is_whole():
    """A variant named in inline code or in a --variants / --optimizer / --baseline list on any
    page is an OPTIMIZER_VARIANTS entry (a rename or removal leaves none behind), and research.md's
    list of the variants already there names every entry, so a variant added without it fails
    here."""
    from nanomuon.variants import OPTIMIZER_VARIANTS

    wrong = []
    for page in PAGES:
        text = page.read_text()
        named = re.findall(r"`([^`\n]+)`", text)
        named += [n for m in re.findall(r"--(?:variants|optimizer|baseline)[ =]([\w,.-]+)", text)
                  for n in m.split(",")]
        wrong += [f"{page.name}: {n}" for n in named
                  if VARIANT.fullmatch(n) and n not in OPTIMIZER_VARIANTS and n not in EXAMPLES]
    assert not wrong, f"names that are not variants: {wrong}"
    text = (ROOT / "docs" / "research.md").read_text()
    start = text.index("The variants already there:")
    listed = set(re.findall(r"`([^`\n]+)`", text[start:text.index("--optimizer NAME", start)]))
    assert listed & set(OPTIMIZER_VARIANTS) == set(OPTIMIZER_VARIANTS), (
        f"research.md's list lacks {sorted(set(OPTIMIZER_VARIANTS) - listed)}")


# A citation of the code is a module and a dotted name after it: `muon.muon_update`,
# `nanomuon.optim.MuonAdamW`, `gpt.GPT.setup_optimizer`, `scripts.ablate`. A module name with a
# file's extension after it is a file (`gpt.py`, `report.md.aside.N`), not a citation.
MODULES = {p.stem: ".".join(p.parent.relative_to(ROOT).parts) for pkg in ("nanomuon", "scripts")
           for p in (ROOT / pkg).rglob("*.py") if p.stem != "__init__"}  # budget: nanomuon.ablation
HEADS = "|".join(sorted({*MODULES, "nanomuon", "scripts"}, key=len, reverse=True))
DOTTED = re.compile(rf"(?<![\w./\\-])(?:{HEADS})(?:\.[A-Za-z_]\w*)+")
EXTENSIONS = {"py", "md", "json", "jsonl", "sh", "pt", "txt", "csv", "yaml", "png", "parquet",
              "zip", "toml", "lock", "bpe", "log"}
FOREIGN = {"attention.output.dense"}  # BERT's module path, which param_groups keeps a Muon matrix


def citations(text: str) -> list[str]:
    names = [m.group(0) for m in DOTTED.finditer(text)]
    return [n for n in names if n.split(".")[1] not in EXTENSIONS and n not in FOREIGN]


def cited_text(path: Path) -> list[str]:
    """What of a file cites the code: a page's code spans and blocks; a Python file's docstrings
    and comments, where names go without backticks."""
    text = path.read_text()
    if path.suffix == ".md":
        blocks = re.findall(r"^ *```[^\n]*\n(.*?)^ *```", text, flags=re.MULTILINE | re.DOTALL)
        text = re.sub(r"^ *```.*?^ *```[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)
        return blocks + re.findall(r"`([^`\n]+)`", text)
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    out = [ast.get_docstring(n, clean=False) or "" for n in ast.walk(ast.parse(text))
           if isinstance(n, nodes)]
    return out + [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline)
                  if t.type == tokenize.COMMENT]


def declared(cls: type, attr: str) -> bool:
    """Whether instances of cls have attr though the class does not: a dataclass field or an
    annotation without a default, or an attribute __init__ (or another method) sets."""
    if attr in getattr(cls, "__dataclass_fields__", {}) or any(
            attr in vars(k).get("__annotations__", {}) for k in cls.__mro__):
        return True
    try:
        return re.search(rf"\bself\.{attr}\b", inspect.getsource(cls)) is not None
    except (OSError, TypeError):
        return False


def resolves(name: str) -> bool:
    """Whether a cited name exists: its module imports as nanomuon.<module> (or scripts.<name>)
    and each name after it is an attribute of the one before."""
    parts = name.split(".")
    package = parts.pop(0) if parts[0] in ("nanomuon", "scripts") else MODULES[parts[0]]
    if not parts:
        return True
    try:
        obj = importlib.import_module(f"{package}.{parts[0]}")
    except ModuleNotFoundError:
        return False
    for attr in parts[1:]:
        if not hasattr(obj, attr):
            return inspect.isclass(obj) and declared(obj, attr)
        obj = getattr(obj, attr)
    return True


def test_the_citation_check_reads_names_not_files():
    assert citations("see `muon.muon_update()`, gpt.py, report.md.aside.N, "
                     "scripts/base_train.py, torch.optim.Muon, -m scripts.ablate, the plan.") == [
        "muon.muon_update", "scripts.ablate"]
    assert resolves("nanomuon.optim.MuonAdamW.step") and resolves("gpt.GPTConfig.arch")
    assert resolves("scripts.ablate") and resolves("gpt.GPT.lm_head")
    assert not resolves("stages.use_gram") and not resolves("optim.MuonAdamW.nope")


def test_every_cited_name_exists():
    """Every module.name the README, docs/*.md and the library's and scripts' docstrings and
    comments cite is in the code: a rename or removal leaves no citation behind."""
    files = [*PAGES, *sorted((ROOT / "nanomuon").rglob("*.py")),
             *sorted((ROOT / "scripts").glob("*.py"))]
    stale = sorted({f"{path.relative_to(ROOT)}: {name}" for path in files
                    for text in cited_text(path) for name in citations(text)
                    if not resolves(name)})
    assert not stale, f"cited names the code does not have: {stale}"
