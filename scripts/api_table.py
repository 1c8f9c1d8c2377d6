"""The API table of docs/api.md: one line per name of ``megatron_tree.__all__``.

Each line links the name to its source file (relative to the page's folder) and gives the
first line of its docstring (continued to the end of the sentence when the line breaks mid-way).
Every name is imported: a name whose module fails to import, that has no docstring or whose
module lies outside the repository raises an error naming it; nothing is skipped.

Usage: python scripts/api_table.py [--page docs/api.md] [--check]
  (no flag: rewrite the table between the page's markers; --check: exit 1 if it is stale)
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"
START, END = "<!-- api-table:start -->", "<!-- api-table:end -->"


def summary(name: str, obj) -> str:
    """The docstring's first line, continued while it ends mid-sentence; Sphinx roles dropped."""
    doc = inspect.getdoc(obj)
    if not doc or not doc.strip():
        raise ValueError(f"megatron_tree.{name} has no docstring")
    lines = doc.strip().split("\n\n", 1)[0].splitlines()
    text = lines[0].strip()
    for line in lines[1:]:
        if text.endswith((".", ":", ";")):
            break
        text += " " + line.strip()
    text = re.sub(r":(?:func|class|meth|attr|mod|data):`~?([^`]+)`", r"`\1`", text)
    text = text.replace("``", "`").replace("|", "\\|")
    return text


def source_file(name: str, obj) -> str:
    """The file of the module defining ``obj``, relative to the repository root."""
    module = getattr(obj, "__module__", None)
    path = getattr(sys.modules.get(module), "__file__", None) if module else None
    if path is None:
        path = inspect.getsourcefile(inspect.unwrap(obj))
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(ROOT).as_posix()
    except ValueError:
        raise ValueError(
            f"megatron_tree.{name} is defined outside the repository: {resolved}"
        ) from None


def render(page: Path = PAGE) -> str:
    """The table for ``page``: each source link relative to the page's folder."""
    import megatron_tree

    base = os.path.relpath(ROOT, Path(page).resolve().parent)
    rows = ["| name | what |", "|---|---|"]
    for name in sorted(megatron_tree.__all__):
        try:
            obj = getattr(megatron_tree, name)
        except Exception as error:  # an optional package missing: fail loudly, naming the name
            raise RuntimeError(f"cannot import megatron_tree.{name}: {error!r}") from error
        link = Path(base, source_file(name, obj)).as_posix()
        rows.append(f"| [`{name}`]({link}) | {summary(name, obj)} |")
    return "\n".join(rows)


def replace(text: str, table: str) -> str:
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"the page needs one {START} ... {END} block")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=Path, default=PAGE, help="the page holding the table")
    parser.add_argument("--check", action="store_true", help="exit 1 if the table is stale")
    args = parser.parse_args(argv)
    text = args.page.read_text(encoding="utf-8")
    new = replace(text, render(args.page))
    if args.check:
        if new != text:
            print(
                f"{args.page}: the API table is stale; run python scripts/api_table.py",
                file=sys.stderr,
            )
            return 1
        return 0
    if new != text:
        args.page.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
