"""
The docs, checked against the tree they describe: every relative link (and #anchor) in README.md and
docs/*.md resolves, the option table in docs/optimizer.md is the one param_groups declares, the
README keeps its shape (at most 250 lines, its sections in order, the test command CI reads, a link
to every docs page), and no page cites an internal issue number. Docs drift silently otherwise: a
renamed file or option leaves a dead link or a wrong table that no other test reads.
"""

import re
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
    """docs/optimizer.md's table of optional muon keys is param_groups.options_table(), made from
    MUON_OPTIONS: a key declared, renamed or re-described there changes the table, and this fails
    until the page follows (`python -c "from nanomuon.param_groups import options_table;
    print(options_table())"` prints it)."""
    from nanomuon.param_groups import MUON_OPTIONS, options_table

    page = (ROOT / "docs" / "optimizer.md").read_text()
    start = page.index("<!-- muon-options")
    table = page[page.index("\n", start) + 1:page.index("<!-- /muon-options -->")].strip()
    assert table == options_table()
    assert [line.split("`")[1] for line in table.splitlines()[2:]] == list(MUON_OPTIONS)


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
    the whole suite, as the README promises."""
    lines = README.read_text().splitlines()
    i = lines.index("<!-- test-command -->")
    assert lines[i + 1] == "```bash"
    assert lines[i + 2].startswith("pip install torch==") and "pytest --slow" in lines[i + 2]


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


# a variant's name as the docs write it; `muon-mine` is research.md's example of one to add
VARIANT = re.compile(r"(?:muon|adamw|torch-muon)(?:-[a-z0-9]+)*")
EXAMPLES = {"muon-mine"}


def test_every_variant_the_docs_name_exists_and_the_list_is_whole():
    """A variant named in inline code or in a --variants / --optimizer / --baseline list on any page is an
    OPTIMIZER_VARIANTS entry (a rename or removal leaves none behind), and research.md's list of the
    variants already there names every entry, so a variant added without it fails here."""
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
    start = text.index("Variants already there:")
    listed = set(re.findall(r"`([^`\n]+)`", text[start:text.index("\n\n", start)]))
    assert listed & set(OPTIMIZER_VARIANTS) == set(OPTIMIZER_VARIANTS), (
        f"research.md's list lacks {sorted(set(OPTIMIZER_VARIANTS) - listed)}")
