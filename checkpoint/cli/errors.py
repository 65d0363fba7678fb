"""How the ``fqnckpt`` command line reports bad input: one line on stderr naming the file, key and
flag at fault, and with ``--json`` one JSON object on stdout (``error``, ``message``, ``file``,
``key``, ``rank``, ``flag``); exit code 2. Errors that are not ours are named as
:class:`~checkpoint.errors.ExternalError`; ``FQNCKPT_TRACEBACK=1`` also prints the traceback."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

EXIT_BAD_INPUT = 2


class BadInput(Exception):
    """Bad command-line input (exit code 2); ``flag`` / ``file`` / ``key`` say what is at fault."""

    def __init__(self, msg: str, flag: str | None = None, file: str | None = None, key: str | None = None):
        super().__init__(msg)
        self.flag, self.file, self.key = flag, file, key


class UsageError(Exception):
    """argparse found a bad command line (its message, exit code 2)."""


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is raised (reported as one line / one JSON object like every
    other bad input) instead of printing usage and exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


# The API's keyword spellings in messages, as the command line spells them.
_FLAG_SPELLINGS = [
    (re.compile(r"\btrusted_globals=\[\.\.\.\] / --trust NAME"), "--trust MODULE.NAME"),
    (re.compile(r"\btrusted_globals=\[\.\.\.\]"), "--trust MODULE.NAME"),
    (re.compile(r"\boverwrite=True"), "--overwrite"),
    (re.compile(r"\ballow_unresolved=True"), "--allow-unresolved"),
    (re.compile(r"\bmodel=(?!\w)"), "--model MODULE:CALLABLE"),
    (re.compile(r"\bfqn_map=(?!\w)"), "--fqn-map FILE"),
    (re.compile(r"\bkey=(?=['\"])"), "--key "),
    (re.compile(r"\bkey=(?=\s|$|[;,.)])"), "--key"),
    (re.compile(r"\bmax_shard_size\b"), "--max-shard-size"),
]


def cli_spelling(msg: str) -> str:
    """``msg`` with the API's keyword arguments replaced by the flags that set them."""
    for rx, flag in _FLAG_SPELLINGS:
        msg = rx.sub(flag, msg)
    return msg


def one_line(msg: str) -> str:
    """One line: multi-line (pydantic, torch) messages joined, pydantic's doc links dropped."""
    lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()]
    return "; ".join(ln for ln in lines if not ln.startswith("For further information visit"))


def _input_file(args: argparse.Namespace) -> str | None:
    for name in ("path", "src", "a"):
        v = getattr(args, name, None)
        if v is not None:
            return str(v)
    return None


def _flag_at_fault(e: BaseException, args: argparse.Namespace) -> str | None:
    """The command-line flag that set the value an error is about, when one did."""
    from ..errors import AmbiguousSourceError, CheckpointExistsError, UnsafePickleError

    if isinstance(e, BadInput):
        return e.flag
    if isinstance(e, UsageError):
        m = re.search(r"(?:argument |arguments: )(-{1,2}[\w-]+)", str(e))
        return m.group(1) if m else None
    if isinstance(e, UnsafePickleError) and (e.globals or e.file == "<trusted_globals>"):
        return "--trust"
    if isinstance(e, AmbiguousSourceError) and (getattr(args, "key", None) is not None or "key" in str(e)):
        return "--key"
    if isinstance(e, CheckpointExistsError):
        return "--overwrite"
    return None


def report_error(e: BaseException, args: argparse.Namespace | None, command: str, as_json: bool) -> int:
    """One line on stderr (and one JSON object on stdout with ``--json``); returns exit code 2."""
    import fqn

    from ..errors import CheckpointError, ExternalError, error_fields

    if args is not None and not isinstance(e, (CheckpointError, fqn.FQNError, BadInput, UsageError)):
        file = getattr(e, "filename", None) if isinstance(e, OSError) else None
        cause, e = e, ExternalError(file or _input_file(args), e, what=command)
        e.__cause__ = cause
    fields = (
        error_fields(e)
        if not isinstance(e, UsageError)
        else {"error": "UsageError", "file": None, "key": None}
    )
    if isinstance(e, BadInput):
        fields.update(error="BadInput", file=e.file or fields.get("file"), key=e.key)
    from ..storage.secrets import scrub, scrub_data

    msg = scrub(cli_spelling(one_line(str(e))))
    flag = _flag_at_fault(e, args) if args is not None else None
    if flag and flag not in msg:
        msg = f"{flag}: {msg}"
    if as_json:
        out = {"ok": False, "command": command, "message": msg, "flag": flag, "exit_code": EXIT_BAD_INPUT}
        out.update({k: fields.get(k) for k in ("error", "file", "key", "rank")})
        print(json.dumps(scrub_data(out), sort_keys=True, default=str))
    print(f"{' '.join(['fqnckpt', command] if command else ['fqnckpt'])}: error: {msg}", file=sys.stderr)
    if os.environ.get("FQNCKPT_TRACEBACK"):
        import traceback

        traceback.print_exception(e)
    return EXIT_BAD_INPUT
