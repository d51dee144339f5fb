"""Files written whole or not at all: a temporary file beside the target, fsynced, then renamed
over it. Every writer of checkpoints, token files, JSON results and images goes through here."""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """Call write(tmp_path) on a temporary file beside `path`, fsync it, then rename it to `path`.
    A path that cannot be written is an OSError naming it (not the temporary file). A symlink is
    followed (its target is replaced, not the link); a pipe or device (`--json /dev/stdout`),
    which cannot be replaced, is written directly."""
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        write(str(path))
        return
    target = Path(os.path.realpath(path)) if path.is_symlink() else path  # renamed onto, the link was replaced
    try:
        if target.is_dir():
            raise IsADirectoryError(errno.EISDIR, "Is a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as e:
        why = f"{e.filename} is a file, not a directory" if isinstance(e, FileExistsError) else e.strerror
        raise type(e)(e.errno, f"cannot write {path}: {why}") from e
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file a normal file's mode
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
