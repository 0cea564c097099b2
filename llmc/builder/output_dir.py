"""The output folder of ``llmc build``: what may be replaced, the atomic swap, and cleanup after killed builds.

Nothing of the user's is ever deleted: an existing folder is replaced only when it holds a valid llmc manifest,
and a temp folder ``.<name>.tmp-<pid>`` (or ``.<name>.old-<pid>``) is removed only when its process is dead on
this host and the folder is recognisably llmc's (its marker file, a valid llmc manifest, or empty).
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmc import manifest as mf
from llmc.errors import BuildError, EngineError

log = logging.getLogger(__name__)

# Written into a temp build folder first thing: which process and host own it (stale-folder cleanup reads it).
TMP_MARKER = ".llmc-build-tmp"
_TMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


@contextmanager
def building_into(out_dir: Path) -> Iterator[Path]:
    """A fresh temp folder beside ``out_dir`` for a build to fill; swapped in when the block ends.

    Makes the parent, removes the temp folders that killed builds left there, marks the temp folder as this
    process's, and on success replaces ``out_dir`` atomically (:func:`replace_dir`). On any failure the temp
    folder is removed and nothing else changes; an OSError (disk full, permission denied) becomes one
    BuildError. The block must have written a valid manifest into the folder."""
    make_parent(out_dir)
    remove_stale_temp_dirs(out_dir.parent)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    remove_tree(tmp)
    try:
        tmp.mkdir()
        write_marker(tmp)
        yield tmp
        (tmp / TMP_MARKER).unlink()  # the folder stays recognisable by its manifest until it is swapped in
        replace_dir(tmp, out_dir)
    except BaseException as exc:
        remove_tree(tmp)
        if isinstance(exc, OSError):
            raise BuildError(f"the build of {out_dir} failed and left nothing behind: {exc.strerror or exc}"
                             f"{f' ({exc.filename})' if exc.filename else ''}. Fix: free space on "
                             f"{out_dir.parent} (or pass -o DIR on another disk) and check its permissions") from exc
        raise


def write_marker(folder: Path) -> None:
    """Mark ``folder`` as a temp build folder of this process on this host."""
    (folder / TMP_MARKER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))


def check_output_location(out_dir: Path) -> None:
    """BuildError unless ``out_dir``'s parent can be created/written and ``out_dir`` is absent or a build.

    Creates nothing: the parent folders are made only once the inputs have been checked.
    """
    fix = "Fix: pass a writable output folder with -o DIR"
    ancestor = out_dir.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise BuildError(f"cannot write the build folder {out_dir}: {ancestor} is a file, not a folder. {fix}")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise BuildError(f"cannot write the build folder {out_dir}: {ancestor} is not writable. {fix}")
    if out_dir.exists() and not out_dir.is_dir():
        raise BuildError(f"the output path {out_dir} is a file. {fix}")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        try:
            mf.read_manifest(out_dir)
        except EngineError as exc:
            raise BuildError(f"the output folder {out_dir} exists and is not an llmc build that this llmc reads "
                             f"({exc}), so llmc will not replace it. {fix}, or remove that folder yourself") from None


def make_parent(out_dir: Path) -> None:
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"cannot create {out_dir.parent}: {exc}. Fix: pass a writable output folder with -o DIR") \
            from exc


def replace_dir(new: Path, target: Path) -> None:
    """Move ``new`` to ``target``, replacing an existing ``target``: one atomic exchange where the system has
    ``renameat2(RENAME_EXCHANGE)`` (Linux), so ``target`` is always the old or the new build; elsewhere the old
    build is renamed away first (a kill in between leaves it as ``.<name>.old-<pid>``, which the next build
    puts back). The old build is deleted last, from ``new``'s path."""
    if not target.exists():
        os.rename(new, target)
        return
    if _exchange(new, target):
        write_marker(new)  # ``new`` now holds the old build: recognisable as a temp folder while it is deleted
        remove_tree(new)
        return
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    remove_tree(old)
    os.rename(target, old)
    try:
        os.rename(new, target)
    except OSError:
        os.rename(old, target)
        raise
    remove_tree(old)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where the system or filesystem
    cannot (non-Linux, old glibc, ENOSYS / EINVAL), and then nothing has changed."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def remove_tree(path: Path) -> None:
    """Delete a temp build folder with its marker file last, so a kill midway leaves it recognisable."""
    if not path.is_dir() or path.is_symlink():
        return
    for child in path.iterdir():
        if child.name != TMP_MARKER:
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
    (path / TMP_MARKER).unlink(missing_ok=True)
    try:
        path.rmdir()
    except OSError:  # something appeared meanwhile: leave it rather than delete what is not ours
        log.warning("could not remove the temp build folder %s", path)


def remove_stale_temp_dirs(parent: Path) -> list[Path]:
    """Remove the ``.<name>.tmp-<pid>`` / ``.<name>.old-<pid>`` folders that builds killed in ``parent`` left.

    Only folders whose process is dead on this host are touched, and only when they are recognisably llmc's
    (the temp marker, a valid llmc manifest, or empty); a ``.old`` folder whose build folder is missing is an
    old build a kill left renamed away, and is put back instead. Returns what was removed or restored."""
    done = []
    for path in sorted(parent.iterdir()):
        match = _TMP_NAME.match(path.name)
        if match is None or not path.is_dir() or path.is_symlink() or _pid_alive(int(match["pid"])):
            continue
        owner = _marker(path)
        if owner is not None and owner.get("host") != socket.gethostname():
            continue  # another machine's build on a shared filesystem: its PID means nothing here
        target = parent / match["name"]
        if match["kind"] == "old" and not target.exists() and _is_llmc_build(path):
            os.rename(path, target)
            log.warning("restored %s from %s (a build was killed while replacing it)", target, path)
        elif owner is not None or _is_llmc_build(path) or not any(path.iterdir()):
            remove_tree(path)
            log.info("removed %s (left by a killed build, pid %s)", path, match["pid"])
        else:
            continue
        done.append(path)
    return done


def _pid_alive(pid: int) -> bool:
    """True unless no process ``pid`` exists (a process of another user counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _marker(path: Path) -> dict[str, Any] | None:
    try:
        owner = json.loads((path / TMP_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _is_llmc_build(path: Path) -> bool:
    try:
        mf.read_manifest(path)
    except EngineError:
        return False
    return True
