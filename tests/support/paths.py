"""Where the tests find the repository (for subprocesses and the docs) and the shared data."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"  # ../shared: the evaluation data, absent on a user's clone


def doc_pages(root: Path = REPO) -> list[Path]:
    """The pages a user reads: the README and every page of docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]
