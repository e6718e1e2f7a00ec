"""The operator's token: where `lifl up` takes it from, and registering it in Redis.

One of: the environment variable LIFL_OPERATOR_TOKEN, or ``--operator-token-file PATH`` (not
both: which one wins would be a guess); without either, DATA_DIR/operator-token, generated on the
first start (root's, 0600) and reused after. ``lifl.auth.OPERATOR_TOKEN`` says what a token may be.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import redis

from lifl.auth import OPERATOR_TOKEN, Tokens

ENVIRONMENT_VARIABLE = "LIFL_OPERATOR_TOKEN"
FILE_NAME = "operator-token"  # in DATA_DIR, when the token is generated
GENERATED_BYTES = 32  # of randomness in a generated token (43 URL-safe characters)
MAX_FILE_BYTES = 4096  # more than any valid token with its whitespace: a bigger file is not a token
FILE_MODE = 0o600


@dataclass(frozen=True)
class OperatorToken:
    token: str
    source: str  # where it came from, for the startup banner: its file, or $LIFL_OPERATOR_TOKEN
    path: Path | None = None  # its file (None: it came from the environment or the caller)


def checked(token: str, source: str, path: Path | None = None) -> OperatorToken:
    if not OPERATOR_TOKEN.fullmatch(token):
        raise ValueError(f"the operator token from {source} is not valid: it must be 32-256 printable ASCII "
                         f"characters without spaces (it has {len(token)} characters)")
    return OperatorToken(token, source, path)


def read_token_file(path: Path) -> OperatorToken:
    """A token kept in a file, around which whitespace (a final newline) does not count."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read the operator token file {path}: {e.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"the operator token file {path} is longer than {MAX_FILE_BYTES} bytes: it is not a token")
    token = raw.decode("ascii", errors="replace").strip()
    if not token:
        raise ValueError(f"the operator token file {path} is empty")
    return checked(token, str(path.absolute()), path.absolute())


def generated_or_kept(data_dir: Path) -> OperatorToken:
    """DATA_DIR/operator-token: made (0600, exclusively) on the first start, read on the others."""
    path = data_dir / FILE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path} is not a regular file; remove it to have a new operator token made") from None
        if stat.S_IMODE(st.st_mode) & 0o077:
            print(f"lifl: {path} was readable by others; made it {FILE_MODE:o} (consider the token leaked)", file=sys.stderr)
            os.chmod(path, FILE_MODE)
        return read_token_file(path)
    token = secrets.token_urlsafe(GENERATED_BYTES)
    try:
        os.write(fd, (token + "\n").encode())
        os.fsync(fd)
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return OperatorToken(token, str(path.absolute()), path.absolute())


def resolve(data_dir: Path, *, given: str | None = None, token_file: Path | None = None,
            environ: Mapping[str, str] = os.environ) -> OperatorToken:
    """The operator's token: ``given`` by a program starting a node, else the environment's or
    ``token_file``'s (not both), else DATA_DIR's. ValueError names what is wrong."""
    if given is not None:
        return checked(given, "the caller")
    from_environment = environ.get(ENVIRONMENT_VARIABLE)
    if from_environment is not None and token_file is not None:
        raise ValueError(f"the operator token comes from ${ENVIRONMENT_VARIABLE} or --operator-token-file, not both")
    if from_environment is not None:
        return checked(from_environment.strip(), f"${ENVIRONMENT_VARIABLE}")
    if token_file is not None:
        return read_token_file(token_file)
    return generated_or_kept(data_dir)


def register(redis_url: str, token: OperatorToken) -> None:
    """Make it the operator's token for everyone using this Redis (replacing any other)."""
    with redis.Redis.from_url(redis_url, decode_responses=True) as client:
        Tokens(client).register_operator(token.token)
