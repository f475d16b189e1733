"""Writing files so that a crash never leaves one half written: write a temporary file
(or directory) beside the target, then rename it over the target (atomic on one
filesystem). The temporary files of :mod:`tempfile` are private (0600 / 0700); what we
rename into place gets the modes any other file the user writes would get (0644 / 0755
under the usual umask), since checkpoints and reports are shared and served from other
accounts and containers."""
from __future__ import annotations

import glob
import os
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path


def current_umask() -> int:
    """The process's umask, read without changing it where /proc says it (Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def set_new_file_mode(path: str | Path) -> None:
    """Give file ``path`` the mode a new file gets under the umask (writers such as
    safetensors' create theirs private)."""
    os.chmod(path, 0o666 & ~current_umask())


def _host() -> str:
    """This machine as temporary names record it (a directory on a shared volume may belong
    to a live process of another machine, whose pid means nothing here)."""
    return "".join(ch if ch.isalnum() else "_" for ch in socket.gethostname())[:40] or "host"


def _owner() -> str:
    """This process as a temporary name records it: host and pid."""
    return f"{_host()}-{os.getpid()}"


def make_temp_dir(target: str | Path, tag: str = "tmp") -> Path:
    """An empty directory beside ``target`` (same filesystem, so it can be renamed onto
    it), hidden by a leading dot and named with this host and process
    (``.NAME.TAG-HOST-PID-XXXX``: :func:`sweep_leftovers` tells a dead run's from a live
    one's); its mode already honours the umask."""
    target = Path(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.{tag}-{_owner()}-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~current_umask())
    return tmp


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's live process
        return True
    return True


def sweep_leftovers(target: str | Path) -> list[Path]:
    """What a run killed outright (SIGKILL, power loss) left beside ``target``, by a
    process that is gone: its temporary directories are deleted, and a ``target`` it had
    moved aside (``.NAME.old-PID-*``) and not yet replaced is put back. Returns what was
    removed or restored."""
    target = Path(target)
    done = []
    if not target.parent.is_dir():
        return done
    host = _host()
    for tag in ("old", "tmp"):   # old first: a restored target makes the tmp beside it moot
        prefix = f".{target.name}.{tag}-{host}-"    # this host's only: another's pids mean nothing here
        for p in sorted(target.parent.glob(glob.escape(prefix) + "*")):
            pid = p.name[len(prefix):].split("-", 1)[0]
            if not pid.isdigit() or _pid_alive(int(pid)) or not p.is_dir():
                continue
            try:
                if tag == "old" and not target.exists():
                    os.rename(p, target)
                else:
                    shutil.rmtree(p, ignore_errors=True)
            except FileNotFoundError:   # another sweeper took it first
                continue
            done.append(p)
    return done


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        set_new_file_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_file(path: str | Path) -> None:
    """Flush ``path``'s data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def replace_dir(tmp: Path, target: Path) -> None:
    """Rename directory ``tmp`` to ``target``; an existing ``target`` is moved aside first
    and deleted only once the new one is in place (restored if the final rename fails)."""
    old = None
    if target.exists():
        old = make_temp_dir(target, "old")
        os.rmdir(old)
        os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(target: str | Path):
    """Yields an empty temporary directory beside ``target``; when the block ends without
    an error its files get the umask's modes and it replaces ``target`` (see
    :func:`replace_dir`); on an error (an interrupt included) it is deleted and ``target``
    is left as it was. What a killed run left beside ``target`` goes first (:func:`sweep_leftovers`)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(target)
    tmp = make_temp_dir(target, "tmp")
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file() and not f.is_symlink():
                set_new_file_mode(f)
        fsync_dir(tmp)
        replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
