"""The one scrubber of credentials: every message of fqnckpt (exceptions, warnings, CLI text and
``--json`` output, reports) passes through :func:`scrub` before a user sees it.

Removed, replaced by ``***``:

- in every URL of a text: the userinfo (``s3://user:pass@host/...``, ``http://tok@gw/``), the query
  string's values (``?apitoken=...``, presigned ``X-Amz-Signature=...``) and the fragment;
- anywhere: ``key=value`` pairs whose key looks like a credential (``Signature=``,
  ``X-Amz-Security-Token=``, ``password=``, ``token=``...) and ``Authorization:`` header values;
- the literal values of every storage option registered by :func:`register` (values under
  credential-like option names at any depth, and the userinfo and query values of URL-valued
  options such as ``endpoint_url``), and of the AWS credential environment variables.

Hand-written (no fsspec / botocore import: plain local paths never load them, and no library
scrubs arbitrary text); the rules are by kind, not by a list of known messages.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from typing import Any

MASK = "***"
_SECRET_NAMES = re.compile(r"key|secret|token|password|passwd|pwd|credential|signature|auth", re.IGNORECASE)
_NOT_SECRET = re.compile(r"version|region|_path$|_file$", re.IGNORECASE)  # signature_version: "s3v4"
_SECRET_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")
# scheme://[userinfo@]host[/path][?query][#fragment], stopping at whitespace and quoting characters.
_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<rest>[^\s'\"`<>()\[\]{}]+)")
# key=value with a credential-like key ending the name (``X-Amz-Signature=``, ``apitoken=``), never
# ``embed_tokens.weight: ...`` (tensor names are not followed by "=").
_PAIR = re.compile(
    r"(?P<k>\b[A-Za-z0-9_\-]*(?:signature|credential|security-token|token|password|passwd|secret|apikey|api_key))"
    r"(?P<eq>=)(?P<v>[^\s&,;'\"`]+)",
    re.IGNORECASE,
)
_AUTH_HEADER = re.compile(r"(Authorization\s*[:=]\s*)([^\s,;'\"]+(?:\s+[^\s,;'\"]+)?)", re.IGNORECASE)  # "Bearer x"

_lock = threading.Lock()
_registered: set[str] = set()


def scrub_url(url: str) -> str:
    """``url`` with its userinfo, query values and fragment replaced by ``***``."""
    m = _URL.match(url)
    if m is None:
        return url
    return m.group("scheme") + _scrub_rest(m.group("rest"))


def _scrub_rest(rest: str) -> str:
    auth, at, after = rest.partition("@")
    if at and "/" not in auth:  # userinfo comes before the host's first "/"
        rest = f"{MASK}@{after}"
    rest, hash_, _frag = rest.partition("#")
    base, q, query = rest.partition("?")
    if q and query:
        pairs = [p.partition("=") for p in query.split("&")]
        query = "&".join(f"{k}={MASK}" if eq else MASK for k, eq, _ in pairs)
        rest = f"{base}?{query}"
    return rest + (f"#{MASK}" if hash_ else "")


def _collect(value: Any, name: str, out: set[str]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _collect(v, str(k), out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, name, out)
    elif isinstance(value, (str, bytes)):
        text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
        if _SECRET_NAMES.search(name) and not _NOT_SECRET.search(name) and len(text) >= 4:
            out.add(text)
        m = _URL.match(text)
        if m is not None:  # a URL-valued option (endpoint_url, proxies): its userinfo and query values
            rest = m.group("rest")
            auth, at, _ = rest.partition("@")
            if at and "/" not in auth:
                out.update(p for p in auth.split(":") if len(p) >= 4)
            query = rest.partition("#")[0].partition("?")[2]
            out.update(v for p in query.split("&") if len(v := p.partition("=")[2] or p) >= 4)


def secrets_of(options: Mapping | None) -> set[str]:
    """The credential strings in ``options`` (see module docstring), without the environment's."""
    out: set[str] = set()
    _collect(options or {}, "", out)
    return out


def register(options: Mapping | None) -> None:
    """Remember the credentials of ``options`` so that every later :func:`scrub` removes them, and
    scrub every log record from then on (:func:`install_log_scrubber`)."""
    found = secrets_of(options)
    if found:
        with _lock:
            _registered.update(found)
    install_log_scrubber()


_log_installed = False


def install_log_scrubber() -> None:
    """Scrub the message of every ``logging`` record made from now on, whoever logs it (botocore /
    s3fs / fsspec log requests, URLs and headers at DEBUG): installed once, by the first store of
    a URL, through :func:`logging.setLogRecordFactory` (a handler or logger filter would miss
    records of loggers configured elsewhere). Records are only made for enabled levels."""
    global _log_installed
    import logging

    with _lock:
        if _log_installed:
            return
        _log_installed = True
    previous = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = previous(*args, **kwargs)
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a malformed record stays as logging would show it
            return record
        record.msg, record.args = scrub(text), ()
        return record

    logging.setLogRecordFactory(factory)


def scrubber(options: Mapping | None = None):
    """A function scrubbing a text: :func:`scrub` plus the credentials of ``options``."""
    extra = sorted(secrets_of(options), key=len, reverse=True)

    def run(text: str) -> str:
        for s in extra:
            text = text.replace(s, MASK)
        return scrub(text)

    return run


def scrub(text: Any) -> str:
    """``text`` (made a str) without any credential (see module docstring)."""
    text = str(text)
    with _lock:
        known = set(_registered)
    known.update(v for k in _SECRET_ENV if len(v := os.environ.get(k, "")) >= 4)
    for s in sorted(known, key=len, reverse=True):
        if s in text:
            text = text.replace(s, MASK)
    text = _URL.sub(lambda m: m.group("scheme") + _scrub_rest(m.group("rest")), text)
    text = _AUTH_HEADER.sub(lambda m: m.group(1) + MASK, text)
    return _PAIR.sub(lambda m: m.group("k") + m.group("eq") + (MASK if m.group("v") != MASK else m.group("v")), text)


def scrub_data(data: Any) -> Any:
    """``data`` (JSON-like: dicts, lists, strings) with every string scrubbed (``--json`` output)."""
    if isinstance(data, str):
        return scrub(data)
    if isinstance(data, Mapping):
        return {scrub(k) if isinstance(k, str) else k: scrub_data(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [scrub_data(v) for v in data]
    return data


__all__ = ["scrub", "scrub_url", "scrub_data", "scrubber", "register", "secrets_of", "install_log_scrubber", "MASK"]
