"""Storage passwords: read from the environment or a file, never written anywhere.

A storage URL such as `postgresql+psycopg://autotune@db:5432/sweeps` carries no password; the
password comes from AUTOTUNE_STORAGE_PASSWORD or the file named by AUTOTUNE_STORAGE_PASSWORD_FILE
(or is written in the URL, which works but is then masked everywhere autotune prints or saves:
the console, autotune.log, best.json's provenance, error messages).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

PASSWORD_ENV = "AUTOTUNE_STORAGE_PASSWORD"
PASSWORD_FILE_ENV = "AUTOTUNE_STORAGE_PASSWORD_FILE"
MASK = "***"

# scheme://user:password@host -> the password part (user and host kept: they help debugging).
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^:/@\s'\"]*:)(?P<password>[^@\s'\"]+)(?P<at>@)")
# libpq-style key=value connection strings and query parameters.
_KEY_PASSWORD = re.compile(r"(?P<head>\bpassword=)(?P<password>[^\s&'\";]+)", re.IGNORECASE)


def mask(text: str) -> str:
    """`text` with every storage password replaced by ***, including a password taken from the
    environment or a file that might appear verbatim (e.g. in a driver's error message)."""
    text = _URL_PASSWORD.sub(lambda m: m["head"] + MASK + m["at"], str(text))
    text = _KEY_PASSWORD.sub(lambda m: m["head"] + MASK, text)
    for secret in _known_passwords():
        text = text.replace(secret, MASK)
    return text


def _known_passwords() -> list[str]:
    found = []
    if os.environ.get(PASSWORD_ENV):
        found.append(os.environ[PASSWORD_ENV])
    path = os.environ.get(PASSWORD_FILE_ENV)
    if path:
        try:
            found.append(Path(path).read_text().strip())
        except OSError:
            pass
    return [secret for secret in found if len(secret) >= 3]  # never mask every "a" in a text


def with_password(url: str) -> str:
    """The URL to connect with: a password from the environment or a file is inserted where the URL
    names a user and no password. Never print what this returns; print `mask(url)`."""
    from autotune.util.errors import UsageError

    path = os.environ.get(PASSWORD_FILE_ENV)
    password = os.environ.get(PASSWORD_ENV)
    if path and not password:
        try:
            password = Path(path).read_text().strip()
        except OSError as exc:
            raise UsageError(f"{PASSWORD_FILE_ENV}={path!r} cannot be read ({exc.strerror}): point it at the "
                             "file holding the storage password") from None
    if not password:
        return url
    match = re.match(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.\-]*://)(?P<user>[^:/@]+)@(?P<rest>.*)$", url)
    if not match:
        return url  # no user, or a password already there: the URL stands as given
    from urllib.parse import quote

    return f"{match['scheme']}{match['user']}:{quote(password, safe='')}@{match['rest']}"
