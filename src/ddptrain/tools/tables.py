"""One renderer for the aligned tables the commands print (doctor, plan) and write (report, benchmarks)."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, align: str = "left",
                 markdown: bool = False) -> str:
    """Columns padded to their widest cell, a rule under the header; `align` "left" or "right".

    Plain: cells two spaces apart, the rule dashes. Markdown: a GitHub table (still aligned in a text view).
    """
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    pad = str.ljust if align == "left" else str.rjust
    if markdown:
        line = lambda cells: "| " + " | ".join(pad(c, w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
        rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    else:
        line = lambda cells: "  ".join(pad(c, w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])
