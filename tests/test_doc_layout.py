"""The docs' layout: every runtime page has the one skeleton of `##` sections that
docs/runtime-api.md describes ("A built-in runtime's page"), docs/benchmarks.md's links to its
run logs resolve, and a quoted section named beside a docs file ("docs/benchmarks.md, "llama.cpp
at E2B width"") is a heading of that file."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUN_LOGS = DOCS / "benchmarks" / "runs"

SKELETON = (
    "What runs",
    "Kinds captured",
    "Precision and tolerance profile",
    "Artifacts and cache",
    "Your own file",
    "Bad input",
    "Upstream findings",
    "Figures at E2B width",
)


def runtime_pages() -> list[Path]:
    """Every built-in runtime's page (docs/runtime-api.md is the plug-in API, not a runtime's page)."""
    return sorted(p for p in DOCS.glob("runtime-*.md") if p.name != "runtime-api.md")


def headings(text: str, level: int | None = None) -> list[str]:
    """The headings of a markdown text (of one level, or every level), outside fenced code blocks,
    whitespace collapsed."""
    out, fence = [], None
    for line in text.split("\n"):
        mark = re.match(r"^(```+|~~~+)", line)
        if mark:
            if fence is None:
                fence = mark.group(1)
            elif line.startswith(fence):
                fence = None
            continue
        m = re.match(r"^(#{1,6}) +(.*?)\s*#*\s*$", line)
        if fence is None and m and (level is None or len(m.group(1)) == level):
            out.append(" ".join(m.group(2).split()))
    return out


def skeleton_problems(text: str) -> list[str]:
    """What keeps a page's `##` headings from being exactly SKELETON, in order ([] when they are)."""
    got = headings(text, level=2)
    if got == list(SKELETON):
        return []
    problems = [f"missing: {h!r}" for h in SKELETON if h not in got]
    problems += [f"not in the skeleton: {h!r}" for h in got if h not in SKELETON]
    problems += [f"{h!r} more than once" for h in SKELETON if got.count(h) > 1]
    if not problems:
        problems.append(f"out of order: {got}")
    return problems


# ---- the runtime pages -------------------------------------------------------------------

PAGE = "# `--runtime x`\n\nIntro.\n\n" + "".join(f"## {h}\n\nText.\n\n### A subsection\n\nMore.\n\n" for h in SKELETON)


def test_the_checker_passes_the_skeleton_and_fails_a_page_that_departs_from_it():
    assert skeleton_problems(PAGE) == []
    missing = PAGE.replace("## Bad input\n", "")
    assert skeleton_problems(missing) == ["missing: 'Bad input'"]
    swapped = (
        PAGE.replace("## Your own file", "## @@")
        .replace("## Bad input", "## Your own file")
        .replace("## @@", "## Bad input")
    )
    assert skeleton_problems(swapped) and "out of order" in skeleton_problems(swapped)[0]
    extra = PAGE + "## Notes\n\nMore.\n"
    assert skeleton_problems(extra) == ["not in the skeleton: 'Notes'"]
    twice = PAGE + "## Bad input\n\nAgain.\n"
    assert skeleton_problems(twice) == ["'Bad input' more than once"]
    renamed = PAGE.replace("## Upstream findings", "## Upstream")
    assert skeleton_problems(renamed) == ["missing: 'Upstream findings'", "not in the skeleton: 'Upstream'"]
    # a `##` line inside a fenced block is code, not a heading; `###` subsections are free
    fenced = PAGE.replace("Intro.\n", "Intro.\n\n```sh\n## not a heading\n```\n")
    assert skeleton_problems(fenced) == []
    assert skeleton_problems(PAGE.replace("### A subsection", "### Anything")) == []


def test_every_runtime_page_has_the_skeleton():
    pages = runtime_pages()
    assert len(pages) >= 8, [p.name for p in pages]
    problems = {p.name: skeleton_problems(p.read_text()) for p in pages}
    assert not any(problems.values()), {k: v for k, v in problems.items() if v}


def test_runtime_api_describes_the_same_skeleton():
    """docs/runtime-api.md lists the sections, numbered and in bold, in the order checked here."""
    text = (DOCS / "runtime-api.md").read_text()
    assert "## A built-in runtime's page" in text
    listed = re.findall(r"^\d+\. \*\*(.+?)\*\*", text, re.M)
    assert tuple(listed) == SKELETON, listed


# ---- docs/benchmarks.md and its run logs -------------------------------------------------

LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)]*)?\)")


def test_the_benchmarks_links_to_run_logs_resolve_and_every_run_log_is_listed():
    text = (DOCS / "benchmarks.md").read_text()
    targets = [t for t in LINK.findall(text) if "benchmarks/runs/" in t]
    assert targets, "docs/benchmarks.md links to no run log"
    missing = sorted({t for t in targets if not (DOCS / t).is_file()})
    assert not missing, f"docs/benchmarks.md links to run logs that do not exist: {missing}"
    index = text[text.index("\n## Run logs") :]
    listed = {(DOCS / t).resolve() for t in LINK.findall(index)}
    logs = sorted(RUN_LOGS.glob("*.md"))
    unlisted = [p.name for p in logs if p.resolve() not in listed]
    assert not unlisted, f"run logs missing from the index at the end of docs/benchmarks.md: {unlisted}"
    bad_names = [p.name for p in logs if not re.match(r"^(\d{4}-\d{2}-\d{2})-[a-z0-9-]+\.md$", p.name)]
    assert not bad_names, f"a run log is named YYYY-MM-DD-topic.md: {bad_names}"


def test_every_run_log_points_back_at_sections_that_exist():
    """A run log's header names the sections of docs/benchmarks.md holding its current figures."""
    heads = set(headings((DOCS / "benchmarks.md").read_text()))
    for log in sorted(RUN_LOGS.glob("*.md")):
        header = " ".join(log.read_text().split("\n---\n")[0].split())
        assert "](../../benchmarks.md)" in header, log.name
        named = [q for q in re.findall(r'"([^"]+)"', header) if q not in ("above", "below", "now")]
        assert named, f"{log.name} names no section of docs/benchmarks.md"
        gone = [q for q in named if q not in heads]
        assert not gone, f"{log.name} names sections docs/benchmarks.md no longer has: {gone}"


# ---- quoted sections beside a docs file name ----------------------------------------------

QUOTED = re.compile(r'(?<![\w/.-])(?:docs/)?([\w-]+\.md)(?:,|:)? \(?"([^"]+)"')


def quoted_section_problems(files) -> list[str]:
    """`docs/X.md, "Heading"` and `docs/X.md ("Heading")` in `files`: each names the start of a
    heading of docs/X.md (or of README.md)."""
    problems = []
    for path in files:
        text = " ".join(path.read_text().split())
        for name, quoted in QUOTED.findall(text):
            target = ROOT / name if name == "README.md" else DOCS / name
            if not target.is_file():
                continue  # not a docs page (a run log names its sections otherwise)
            if not any(h.startswith(quoted) for h in headings(target.read_text())):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
                problems.append(f'{where}: {name}, "{quoted}" is no heading of {name}')
    return problems


def test_quoted_sections_of_docs_pages_are_headings_there():
    files = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((DOCS / "upstream").glob("*.md"))]
    assert not (problems := quoted_section_problems(files)), "\n".join(problems)


def test_the_quoted_section_checker_fails_a_heading_that_is_gone(tmp_path):
    page = tmp_path / "page.md"
    page.write_text('See docs/benchmarks.md, "llama.cpp at E2B width", and docs/benchmarks.md ("No such section").\n')
    assert quoted_section_problems([page]) == [
        'page.md: benchmarks.md, "No such section" is no heading of benchmarks.md'
    ]
