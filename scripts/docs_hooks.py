"""MkDocs hooks for the user guide (mkdocs.yml): pages that are generated or included, so they cannot rot.

- ``docs/reference/config.md`` is generated from the typed config (``puma.config``): every key once, with
  its type, default and the description written beside its field (what ``--help-config`` prints).
  ``python scripts/docs_hooks.py`` writes it; the build fails while the committed page differs.
- ``<!-- bench: NAME -->`` on a line of its own is replaced by ``bench/results/NAME.md``, the table a
  benchmark recorded with its machine, device and commit (headings moved two levels down).
- ``<!-- quickstart: NAME -->`` must stand right above a ```bash block: tests/test_docs.py runs it.
A missing benchmark record or a marker in the wrong place fails the build.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from puma import config as puma_config  # noqa: E402

BENCH = re.compile(r"^<!-- bench: ([\w.-]+) -->$", re.M)
QUICKSTART = re.compile(r"^<!-- quickstart: ([\w-]+) -->\n(.*)$", re.M)
CONFIG_PAGE = "reference/config.md"
BENCH_FIGURES = "assets/bench"  # bench/results/*.png in the site
FIGURE = re.compile(r"\]\(([\w.-]+\.png)\)")


def on_files(files, config):
    """Check the config reference is current; add the benchmarks' figures (for their included tables)."""
    page = REPO / "docs" / CONFIG_PAGE
    if not page.is_file() or page.read_text() != config_reference():
        raise PluginError(f"docs/{CONFIG_PAGE} is not the typed config's: run python scripts/docs_hooks.py")
    for figure in sorted((REPO / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"{BENCH_FIGURES}/{figure.name}", abs_src_path=str(figure)))
    return files


def on_page_markdown(markdown, page, config, files):
    """Include recorded benchmark tables; check quick-start markers."""
    for name, line in QUICKSTART.findall(markdown):
        if not line.startswith("```bash"):
            raise PluginError(f"{page.file.src_uri}: <!-- quickstart: {name} --> must stand right above a "
                              f"```bash block (tests/test_docs.py runs it), found {line[:40]!r}")
    return BENCH.sub(lambda match: bench_table(match.group(1), page.file.src_uri), markdown)


def bench_table(name: str, page: str) -> str:
    """bench/results/<name>.md, its headings two levels down, and where it is recorded."""
    path = REPO / "bench" / "results" / f"{name}.md"
    if not path.is_file():
        raise PluginError(f"{page}: <!-- bench: {name} --> names {path.relative_to(REPO)}, which does not "
                          "exist")
    body = re.sub(r"^(#+) ", lambda m: "#" * min(len(m.group(1)) + 2, 6) + " ", path.read_text(), flags=re.M)
    up = "../" * page.count("/")
    body = FIGURE.sub(lambda m: f"]({up}{BENCH_FIGURES}/{m.group(1)})", body)
    return f"{body.rstrip()}\n\n*Recorded in `bench/results/{name}.md` (`bench/results/{name}.json`).*\n"


def config_reference() -> str:
    """Every config key, grouped by section, in declaration order."""
    lines = ["# Config keys", "",
             "Every key a job accepts, generated from the typed config (`puma/config/`) when this guide is "
             "built: the same text as `python jobs/train.py --help-config`. A job reads its defaults, then "
             "`--config FILE` (or `$PUMA_CONFIG`, else `configs/demo.yaml`), then `key=value` overrides; an "
             "unknown key or a value of the wrong type is an error naming the closest valid key. The "
             "resolved config is saved with every checkpoint, index and report.", ""]
    by_section: dict[str, list[tuple[str, str, str, str]]] = {}
    for row in puma_config.describe_keys():
        by_section.setdefault(row[0].rsplit(".", 1)[0], []).append(row)
    for prefix, cls in _sections(puma_config.Config):
        keys = by_section.get(prefix)
        if not keys:
            continue
        lines += [f"## `{prefix}`", ""]
        if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
            lines += [" ".join(cls.__doc__.replace("``", "`").split()), ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        lines += [f"| `{key}` | {_cell(tp)} | `{_cell(default)}` | {_cell(doc)} |"
                  for key, tp, default, doc in keys]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _sections(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """(dotted prefix, dataclass) of every nested config section, parents first."""
    out = [(prefix, cls)] if prefix else []
    for name, tp in puma_config._field_types(cls).items():
        if puma_config._is_dataclass_type(tp):
            out += _sections(tp, f"{prefix}.{name}" if prefix else name)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


if __name__ == "__main__":
    (REPO / "docs" / CONFIG_PAGE).write_text(config_reference())
    print(f"wrote docs/{CONFIG_PAGE}")
