"""mkdocs hooks: pages that are generated from the code at build time, so they cannot drift.

- ``<!-- fqnckpt:cli -->`` becomes the ``--help`` text of ``fqnckpt`` and of every subcommand,
  taken from the argparse parser the command line itself builds (``checkpoint.cli.main.build_parser``).
- ``<!-- fqnckpt:errors MODULE -->`` becomes a table of the exception and warning classes defined in
  ``MODULE``: name, bases and the docstring's first paragraph.
- The docstrings use Sphinx cross-reference roles (``:func:`~.pread.pread_run```), which
  mkdocstrings' Google-style parser leaves as text: the rendered pages show them as code spans.

The build imports the packages (``pip install -e ".[docs]"``): a renamed command or error shows
here on the next build.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import io
import re
from contextlib import redirect_stdout

_CLI = "<!-- fqnckpt:cli -->"
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):<code>~?\.?")
_ERRORS = re.compile(r"<!-- fqnckpt:errors ([\w.]+) -->")


def _help(parser: argparse.ArgumentParser) -> str:
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
    out = io.StringIO()
    with redirect_stdout(out):
        parser.print_help()
    return out.getvalue().rstrip()


def cli_reference() -> str:
    """Markdown: ``fqnckpt --help`` and ``fqnckpt COMMAND --help`` for every command, in order."""
    from checkpoint.cli.main import build_parser

    parser = build_parser()
    parts = ["## `fqnckpt`", "", "```text", _help(parser), "```", ""]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        p.prog = f"fqnckpt {name}"
        parts += [f"## `fqnckpt {name}`", "", "```text", _help(p), "```", ""]
    return "\n".join(parts)


def _first_paragraph(obj) -> str:
    doc = inspect.getdoc(obj) or ""
    para = doc.split("\n\n", 1)[0]
    para = " ".join(line.strip() for line in para.splitlines())
    para = re.sub(r":\w+:`~?\.?([^`]+)`", r"`\1`", para)  # Sphinx roles -> code spans
    return para.replace("|", "\\|")


def errors_table(module_name: str) -> str:
    """Markdown table of the exception / warning classes defined in ``module_name``."""
    module = importlib.import_module(module_name)
    rows = ["| error | is a | raised when |", "|---|---|---|"]
    for name, cls in vars(module).items():
        if not (inspect.isclass(cls) and issubclass(cls, BaseException)):
            continue
        if cls.__module__ != module_name or name.startswith("_"):
            continue
        bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
        rows.append(f"| `{name}` | {bases} | {_first_paragraph(cls)} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if _CLI in markdown:
        markdown = markdown.replace(_CLI, cli_reference())
    return _ERRORS.sub(lambda m: errors_table(m.group(1)), markdown)


def on_page_content(html: str, page, config, files) -> str:
    """``:func:<code>~.x.y</code>`` (a Sphinx role rendered by mkdocstrings) -> ``<code>x.y</code>``."""
    return _ROLE.sub("<code>", html)
