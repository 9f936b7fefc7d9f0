"""Atomic file writes: a temporary file in the target's directory, then a rename.

Every file colltune writes for the user (profiles, policies, reports, JSON)
goes through :func:`atomic_path`, so an interrupted command never leaves a
half-written file where a good one was.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator

__all__ = ["atomic_path", "write_text_atomic"]


def _file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path beside ``path``; rename it over ``path`` when the block succeeds.

    The file gets the mode a plain ``open(path, "w")`` would give. If the
    block raises, the temporary file is removed and ``path`` is untouched.

    Example:
        >>> with atomic_path("out.png", ".png") as tmp:  # doctest: +SKIP
        ...     fig.savefig(tmp)
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".colltune-", suffix=suffix, dir=directory)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str, text: str, suffix: str = ".tmp") -> None:
    """Write ``text`` to ``path`` atomically (UTF-8)."""
    with atomic_path(path, suffix) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
