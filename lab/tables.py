"""Fixed-width tables, as the benchmarks print their figures."""

from __future__ import annotations


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """`columns`: (key, header, format spec); missing values print as '-'."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(k) is None else format(row[k], spec))
                      for k, _, spec in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for c, w in zip(r, widths)))
