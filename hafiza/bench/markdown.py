"""Generated regions of docs/BENCHMARKS.md: `bench all` rewrites only the text between its own markers.

Each benchmark owns a region `<!-- bench:NAME:start -->` … `<!-- bench:NAME:end -->` inside its section (the
`## TITLE` heading). Prose written by hand around the markers, and every other section, is kept
byte for byte. A region that does not exist yet is added at the end of its section; a section that does not
exist yet is added at the end of the document.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Region:
    """Where one generated block goes: its marker name and the title of its `## ` section."""

    name: str
    title: str

    @property
    def start(self) -> str:
        return f"<!-- bench:{self.name}:start -->"

    @property
    def end(self) -> str:
        return f"<!-- bench:{self.name}:end -->"


def _section_span(doc: str, title: str) -> tuple[int, int] | None:
    """(start of the heading line, end of the section) of the first `## TITLE` section."""
    heading = re.compile(rf"^## {re.escape(title)}[ \t]*$", re.M)
    m = heading.search(doc)
    if m is None:
        return None
    nxt = re.compile(r"^## ", re.M).search(doc, m.end())
    return m.start(), nxt.start() if nxt else len(doc)


def replace_region(doc: str, region: Region, body: str) -> str:
    """`doc` with `region`'s content set to `body` (see the module docstring)."""
    block = f"{region.start}\n{body.strip()}\n{region.end}"
    i = doc.find(region.start)
    j = doc.find(region.end, i + len(region.start)) if i >= 0 else -1
    if i >= 0 and j >= 0:
        return doc[:i] + block + doc[j + len(region.end):]
    span = _section_span(doc, region.title)
    if span is None:
        sep = "" if doc.endswith("\n\n") or not doc else ("\n" if doc.endswith("\n") else "\n\n")
        return f"{doc}{sep}## {region.title}\n\n{block}\n"
    _, end = span
    head, tail = doc[:end].rstrip("\n"), doc[end:]
    return f"{head}\n\n{block}\n" + ("\n" + tail if tail else "")


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table (cells are str()-ed, pipes escaped)."""
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
