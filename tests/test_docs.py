"""The README and the user guide: a README a newcomer reads in five minutes whose links all land, and a
config reference with every key once. (`mkdocs build --strict` in scripts/test.sh checks the guide's own
links and nav; tests/test_quickstarts.py runs the quick starts.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

from puma.config import describe_keys

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import docs_hooks  # noqa: E402

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # no headings in code blocks
    return {slugify(title.strip().replace("`", ""), "-") for title in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_readme_is_short_and_every_link_lands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    links = [link for link in LINK.findall(text) if not link.startswith(("http://", "https://"))]
    assert links
    for link in links:
        path, _, anchor = link.partition("#")
        target = REPO / path
        assert target.exists(), f"README links {link}: no such file"
        if anchor:
            assert anchor in _anchors(target), f"README links {link}: no heading makes #{anchor}"


def test_the_readme_reaches_the_four_tasks_within_two_clicks():
    """Train on a CSV catalogue, serve it, export the model, run on Kubernetes: each one README link away
    from the page that explains it."""
    links = set(LINK.findall((REPO / "README.md").read_text()))
    for page in ("docs/data.md#train-on-a-table-csv-of-your-own", "docs/serving.md", "docs/export.md",
                 "docs/kubernetes.md"):
        assert page in links, page
    csv = (REPO / "docs" / "data.md").read_text().split("## Train on a table (CSV) of your own", 1)[1]
    assert "--preset table" in csv and "jobs/train.py" in csv
    assert "## Start it" in (REPO / "docs" / "serving.md").read_text()


def test_the_config_reference_lists_every_key_once_with_its_default():
    page = (REPO / "docs" / "reference" / "config.md").read_text()
    assert page == docs_hooks.config_reference(), "stale: run python scripts/docs_hooks.py"
    rows = re.findall(r"^\| `([\w.]+)` \| (.*?) \| `(.*?)` \|", page, re.M)
    assert [key for key, _, _ in rows] == [key for key, _, _, _ in describe_keys()]
    assert ("serve.max_queued_requests", "int", "256") in rows
    assert ("model.adapter.blocks", "list[int] \\| null", "null") in rows
