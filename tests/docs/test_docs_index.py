"""docs/index.md lists every page in docs/, and every page it links to is there."""
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_index_lists_every_page_and_only_pages_that_exist():
    linked = re.findall(r"^\| \[([\w.-]+\.md)\]\(\1\) \|", (DOCS / "index.md").read_text(), re.M)
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    assert sorted(linked) == pages
