"""Which paths are URLs (``scheme://...``: ``s3://``, ``memory://``, ``file://``, ...) and how they
are shown in messages. No fsspec import here: plain local paths never load it.

A URL is never taken as a local path: every entry point resolves it through
:func:`checkpoint.storage.location.resolve` (fsspec), or refuses it with
:class:`~checkpoint.errors.UnsupportedStorageError`.
"""

from __future__ import annotations

import os
import re

# RFC 3986 scheme, then "://". One letter before ":" is a Windows drive ("C:\\..."), never a URL.
# fsspec's chained form ("simplecache::s3://b/ck") is a URL too (scheme "simplecache::s3"): as a
# local path it would silently write a directory named "simplecache::s3:" here.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+(?:::[A-Za-z][A-Za-z0-9+.\-]+)*)://")


def url_scheme(path: object) -> str | None:
    """The lower-cased scheme of a ``scheme://...`` string or PathLike, else None."""
    if not isinstance(path, str):
        if not isinstance(path, os.PathLike):
            return None
        path = os.fspath(path)
        if not isinstance(path, str):
            return None
    m = _URL.match(path)
    return m.group(1).lower() if m else None


def is_url(path: object) -> bool:
    """True for ``scheme://...`` (see :func:`url_scheme`)."""
    return url_scheme(path) is not None


def check_url(url: str) -> None:
    """Refuse a URL carrying a query (``s3://b/ck?versionId=3``, presigned ``?X-Amz-...``) or a
    fragment (``#...``): checkpoint objects are read and written by plain names under the URL, so
    neither could apply (an object version cannot be written; s3fs would take ``versionId`` for
    the prefix, not for the files under it). Called by
    :func:`checkpoint.storage.location.resolve`, which every entry point goes through.

    Raises:
        UnsupportedURLError: naming the URL (values masked) and the query keys / fragment.
    """
    scheme = url_scheme(url) or ""
    rest, hash_, _ = url.partition("#")
    _, q, query = rest.partition("?")
    parts = []
    if q:
        # Only the keys of key=value items: a bare item (?<token>) may itself be the secret,
        # which redact_url masks as a value.
        keys = [k for k, eq, _ in (p.partition("=") for p in query.split("&") if p) if eq]
        parts.append(f"query keys {keys}" if keys else "a query" if query.strip("&") else "an empty query '?'")
    if hash_:
        parts.append("a fragment")
    if parts:
        from ..errors import UnsupportedURLError

        raise UnsupportedURLError(redact_url(url), scheme, parts)


def normalize_url(url: str) -> str:
    """``url`` with its path normalised as a local path is by the OS: empty segments (``//``)
    and ``.`` segments removed, no trailing ``/`` (a checkpoint URL is a prefix). Object stores
    take a key literally, so ``s3://b//ck`` would otherwise write under ``b/`` + ``/ck/...`` (an
    empty-named folder) and ``s3://b/./ck`` under a folder named ``.``, where a local save to
    ``/b//ck`` or ``/b/./ck`` writes ``/b/ck``. A leading ``/`` (``file:///tmp/ck``,
    ``memory:///ck``) and ``..`` segments are kept as given. Not a URL: returned unchanged."""
    m = _URL.match(url)
    if m is None:
        return url
    rest = url[m.end() :]
    lead = "/" if rest.startswith("/") else ""
    return url[: m.end()] + lead + "/".join(s for s in rest.split("/") if s not in ("", "."))


def redact_url(url: str) -> str:
    """``url`` as messages show it: userinfo, query values and fragment replaced by ``***``
    (:func:`checkpoint.storage.secrets.scrub_url`; credentials never reach a message)."""
    from .secrets import scrub_url

    return scrub_url(url)


__all__ = ["url_scheme", "is_url", "check_url", "normalize_url", "redact_url"]
