"""Keeping credentials out of URLs and error messages shown by the remote backends.

Storage options and connection strings carry keys and SAS tokens, and client libraries
sometimes echo a signed request URL in their exceptions. Every message a backend builds from
a client's error goes through ``scrub`` first; every printable URL through ``redact_url``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_SECRET_PATTERNS = (  # (pattern, replacement)
    (re.compile(r"(?i)\b(AccountKey|SharedAccessSignature|sig|secret|password|token)=[^;&\s'\"]+"), r"\1=***"),
    (re.compile(r"(?i)\b(Authorization:\s*)\S+(\s\S+)?"), r"\1***"),
)
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*:[^/@]*@")


def redact_url(url: str) -> str:
    """``url`` without a ``user:password@`` part or a query string (SAS tokens live there)."""
    url = _USERINFO.sub(r"\1", url)
    return url.split("?", 1)[0]


def scrub(text: str, secrets: Iterable[object] = ()) -> str:
    """``text`` with known secret values and ``key=value`` credentials replaced by ``***``."""
    for value in secrets:
        if isinstance(value, str) and len(value) >= 4:
            text = text.replace(value, "***")
    for pattern, replacement in _SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text
