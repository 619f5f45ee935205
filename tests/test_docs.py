"""The README and the user guide: a README a newcomer reads in five minutes whose links all land, a
config reference with every key once, and no page naming a config key or a job option that does not
exist. (`mkdocs build --strict` in scripts/test.sh checks the guide's own links and nav;
tests/test_quickstarts.py runs the quick starts.)"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

from puma.config import describe_keys

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import docs_hooks  # noqa: E402

LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SECTIONS = "model|loss|optim|data|storage|train|eval|index|embed|serve|sweep"
DOTTED = re.compile(rf"(?<![\w/.@-])(?:{SECTIONS})\.[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*")
FILE_NAME = (".md", ".py", ".html", ".json", ".jsonl", ".yaml", ".yml", ".png", ".txt", ".csv", ".parquet",
             ".onnx", ".npy", ".safetensors")
COMMAND = re.compile(r"((?:jobs/[a-z_]+|tune/sweep)\.py)([^\n|`]*)")  # jobs/X.py: a placeholder
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _code(page: Path) -> list[str]:
    """The code blocks and code spans of a page (shell continuation lines joined)."""
    text = page.read_text().replace("\\\n", " ")
    return re.findall(r"^```.*?^```", text, re.M | re.S) + re.findall(r"`[^`\n]+`", text)


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


def _python_name(dotted: str) -> bool:
    """``storage.configure``, ``train.driver.run_training``: a name in the puma package."""
    module, _, attr = f"puma.{dotted}".rpartition(".")
    try:
        if hasattr(importlib.import_module(module), attr):
            return True
        return bool(importlib.import_module(f"puma.{dotted}"))  # a module
    except ImportError:
        return False


def test_every_dotted_config_key_the_pages_name_exists():
    """A key renamed or removed in puma/config/ fails here until every page is updated."""
    keys = {key for key, *_ in describe_keys()}
    sections = {key.rsplit(".", n)[0] for key in keys for n in range(1, key.count(".") + 1)}
    source = "\n".join(path.read_text() for path in (REPO / "puma").rglob("*.py"))
    fault_points = set(re.findall(r"fault_(?:point|delay|hold)\(\"([\w.]+)\"\)", source))
    unknown = {}
    for page in PAGES:
        for code in _code(page):
            for name in DOTTED.findall(code):
                if name in keys or name in sections or name in fault_points or name.endswith(FILE_NAME):
                    continue
                if not _python_name(name):
                    unknown.setdefault(name, set()).add(str(page.relative_to(REPO)))
    assert not unknown, f"pages name config keys that do not exist: {unknown}"


def test_every_job_option_the_pages_use_exists():
    """`jobs/X.py --flag` in a page's code: the job's --help lists --flag."""
    options = {}
    for job in [*sorted((REPO / "jobs").glob("*.py")), REPO / "tune" / "sweep.py"]:
        shown = subprocess.run([sys.executable, str(job), "--help"], capture_output=True, text=True,
                               timeout=60)
        assert shown.returncode == 0, shown.stderr[-2000:]
        options[str(job.relative_to(REPO))] = set(FLAG.findall(shown.stdout))
    wrong = []
    for page in PAGES:
        for code in _code(page):
            for job, rest in COMMAND.findall(code):
                flags = FLAG.findall(rest.split("#")[0])
                where = str(page.relative_to(REPO))
                wrong += [(where, job, flag) for flag in flags if flag not in options[job]]
    assert not wrong, f"options the jobs do not have: {wrong}"
