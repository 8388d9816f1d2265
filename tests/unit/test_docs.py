"""The docs stay short enough to read and the code stays linted, checked in `make test`.

Each page of README.md and docs/ has a line budget: a page grows past it only by a change that
raises its budget here, in review. Figures that change with each measurement belong on the
generated scorecard pages and in the changelog, not in the prose pages. The commands the pages
give are parsed by their own parsers in `tests/unit/jobs/test_cli_help.py`; ruff runs on the code
with the configuration in pyproject.toml (`ruff` is in requirements-dev.txt).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO, doc_pages

DEFAULT_LINES = 400  # a page a reader finishes
LINE_BUDGETS = {
    "README.md": 250,  # the two commands first, then a map of the rest
    "quality.md": 250,  # where the default stands and why; the figures live on the scorecards
    "changelog.md": 250,  # one dated line per change: older lines are cut when it fills
    "serving.md": 720,  # the HTTP API reference: every route, field and status (to be split)
}


def pages_over_budget(root: Path) -> list[str]:
    """Each page longer than its budget, as `name: lines > budget`."""
    over = []
    for page in doc_pages(root):
        if page.exists():
            lines = len(page.read_text(encoding="utf-8").splitlines())
            budget = LINE_BUDGETS.get(page.name, DEFAULT_LINES)
            if lines > budget:
                over.append(f"{page.name}: {lines} lines > {budget}")
    return over


def test_every_page_is_within_its_line_budget():
    assert pages_over_budget(REPO) == []


def test_a_page_made_too_long_fails_the_check(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# short\n", encoding="utf-8")
    (tmp_path / "docs" / "quality.md").write_text("line\n" * 250, encoding="utf-8")
    (tmp_path / "docs" / "other.md").write_text("line\n" * DEFAULT_LINES, encoding="utf-8")
    assert pages_over_budget(tmp_path) == []  # at the budget is within it
    (tmp_path / "docs" / "quality.md").write_text("line\n" * 251, encoding="utf-8")
    (tmp_path / "docs" / "other.md").write_text("line\n" * (DEFAULT_LINES + 1), encoding="utf-8")
    assert pages_over_budget(tmp_path) == [f"other.md: {DEFAULT_LINES + 1} lines > "
                                           f"{DEFAULT_LINES}", "quality.md: 251 lines > 250"]


def test_ruff_finds_nothing_in_the_code():
    """The linter, as configured in pyproject.toml, over the whole repository."""
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def _headings(page: Path) -> set[str]:
    """The anchors a page's headings get (GitHub's: lower case, punctuation dropped, spaces as
    hyphens), code blocks left out."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


_LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")  # (target, section) of a Markdown link


def test_every_relative_link_names_a_file_and_a_heading():
    """Every relative link of the README and docs/ names a file of the repository, and a link
    to `page.md#section` a heading of that page (a page rewritten short drops sections that
    other pages linked to)."""
    broken = []
    for page in doc_pages(REPO):
        for target, anchor in _LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target or not (target or anchor):
                continue
            linked = page.parent / target if target else page
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _headings(linked):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert broken == []


def _first_command(page: Path) -> str:
    """The command a generated page was made by: the first line of its first code block."""
    block = re.search(r"```bash\n(.*?)\n", page.read_text(encoding="utf-8"))
    assert block, f"{page.name}: no command"
    return block.group(1).strip()


def test_the_readme_gives_the_commands_that_made_the_scorecard_pages():
    """The README's scorecard commands are those each generated page says made it, so running
    the README's line remakes the page it points to."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    given = {line.strip().removeprefix(".venv/bin/") for line in readme.splitlines()}
    for name in ("scorecard.md", "scorecard-full.md", "scorecard-retrieval.md"):
        command = _first_command(REPO / "docs" / name)
        assert f"--page docs/{name}" in command, command
        assert command in given, f"README.md lacks the command that made docs/{name}"
