"""The report page: one self-contained HTML file (inline CSS, no scripts) beside its PNGs.

Every number in the metrics table sits in a cell with ``data-source`` ("this run", "zero-shot" or a
compared run's name), ``data-metric`` (e.g. ``harmonic/r@1``) and ``data-value`` (the full float, as
report.json has it); the cell's text is the value to 4 decimals.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from puma.report.figures import group_names

THIS_RUN, ZERO_SHOT = "this run", "zero-shot"
TABLE_METRICS = ("r@1", "map@r", "rp")
METRICS_NOTE = ("this run: every neighbour searched through the index (the numbers of jobs/evaluate.py, "
                "report.json); zero-shot: the frozen backbone, as the run evaluated it before training; "
                "other runs: what their best checkpoint recorded. Change: this run's R@1 minus zero-shot.")
CSS = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; }
h1 { margin-bottom: 4px; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 4px; margin-top: 32px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 14px; }
th, td { border: 1px solid #ddd; padding: 3px 10px; text-align: right; }
th:first-child, td:first-child, table.facts td { text-align: left; }
tr.summary td { font-weight: 600; background: #f6f6f6; }
td.up { color: #0a7a0a; } td.down { color: #b41e1e; }
figure { margin: 12px 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 13px; color: #555; }
p.note { color: #666; font-style: italic; }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; font-size: 12px; }
nav a { margin-right: 12px; }
"""


@dataclass
class Picture:
    """A PNG beside the page (a file name relative to it) and its caption."""

    file: str
    caption: str


@dataclass
class Section:
    """A titled part of the page: its pictures and one-line notes (why something is not shown)."""

    title: str
    anchor: str
    pictures: list[Picture] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class PageContent:
    """Everything the page shows."""

    title: str
    facts: list[tuple[str, str]]  # (label, value) in the header
    versions: dict[str, str]
    configs: list[tuple[str, str]]  # (summary, YAML text), each in a <details>
    metrics: dict[str, float]  # this run, through the index
    zero_shot: dict[str, float]
    compare: dict[str, dict[str, float]]
    sections: list[Section]


def render(page: PageContent) -> str:
    """The page's HTML text."""
    body = [f"<h1>{_e(page.title)}</h1>", _nav(page), _header(page), '<h2 id="metrics">Metrics</h2>',
            f"<p>{_e(METRICS_NOTE)}</p>", metrics_table(page.metrics, page.zero_shot, page.compare)]
    body += [_section(s) for s in page.sections]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_e(page.title)}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _nav(page: PageContent) -> str:
    links = ['<a href="#metrics">metrics</a>'] + [f'<a href="#{_e(s.anchor)}">{_e(s.title.lower())}</a>'
                                                 for s in page.sections]
    return "<nav>" + "".join(links) + "</nav>"


def _header(page: PageContent) -> str:
    rows = "".join(f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in page.facts)
    versions = ", ".join(f"{_e(k)} {_e(v)}" for k, v in sorted(page.versions.items())) or "not recorded"
    configs = "".join(f"<details><summary>{_e(s)}</summary><pre>{_e(text)}</pre></details>"
                      for s, text in page.configs)
    return (f'<table class="facts">{rows}<tr><td>library versions (checkpoint)</td><td>{versions}</td></tr>'
            f"</table>{configs}")


def _cell(source: str, key: str, value: float | None, css: str = "") -> str:
    if value is None:
        return "<td>-</td>"
    cls = f' class="{css}"' if css else ""
    return (f'<td{cls} data-source="{_e(source)}" data-metric="{_e(key)}" data-value="{float(value)!r}">'
            f"{value:.4f}</td>")


def metrics_table(metrics: dict[str, float], zero_shot: dict[str, float],
                  compare: dict[str, dict[str, float]]) -> str:
    """Per dataset, unified and harmonic: this run's R@1 / MAP@R / RP, zero-shot and other runs' R@1."""
    head = ["dataset", *(f"{THIS_RUN} {m.upper()}" for m in TABLE_METRICS), "zero-shot R@1", "change"]
    head += [f"{name} R@1" for name in compare]
    lines = ["<table class=\"metrics\"><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>"]
    for name in group_names({THIS_RUN: metrics, ZERO_SHOT: zero_shot, **compare}, "r@1"):
        key = f"{name}/r@1"
        cells = [_cell(THIS_RUN, f"{name}/{m}", metrics.get(f"{name}/{m}")) for m in TABLE_METRICS]
        cells.append(_cell(ZERO_SHOT, key, zero_shot.get(key)))
        cells.append(_change(metrics.get(key), zero_shot.get(key)))
        cells += [_cell(run, key, values.get(key)) for run, values in compare.items()]
        css = ' class="summary"' if name in ("unified", "harmonic") else ""
        lines.append(f"<tr{css}><td>{_e(name)}</td>{''.join(cells)}</tr>")
    lines.append("</table>")
    return "\n".join(lines)


def _change(after: float | None, before: float | None) -> str:
    if after is None or before is None:
        return "<td>-</td>"
    return f'<td class="{"up" if after >= before else "down"}">{after - before:+.4f}</td>'


def _section(section: Section) -> str:
    parts = [f'<h2 id="{_e(section.anchor)}">{_e(section.title)}</h2>']
    parts += [f'<p class="note">{_e(note)}</p>' for note in section.notes]
    parts += [f'<figure><img src="{_e(p.file)}" alt="{_e(p.caption)}"><figcaption>{_e(p.caption)}'
              "</figcaption></figure>" for p in section.pictures]
    return "\n".join(parts)
