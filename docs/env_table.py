"""Write the environment-variable tables of docs/reference/environment.md from
asynclock's settings declaration: `python docs/env_table.py` (`--check` exits 1 when
the page differs; tests/test_settings.py runs the check)."""

from __future__ import annotations

import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent / "reference" / "environment.md"
START, END = "<!-- env-table -->", "<!-- /env-table -->"


def rendered(page: str) -> str:
    """`page` with the text between the markers replaced by the generated tables."""
    from asynclock._core.base.settings import markdown_table

    head, _, rest = page.partition(START)
    _, _, tail = rest.partition(END)
    return f"{head}{START}\n\n{markdown_table()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    page = PAGE.read_text()
    want = rendered(page)
    if "--check" in argv:
        return int(want != page)
    PAGE.write_text(want)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
