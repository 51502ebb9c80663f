"""Index folders written as transactions, and checked when read.

A writer (``deepmetric index``, ``index --add``, :meth:`Index.save`) never touches the files of
the folder it replaces. It takes a lock on the parent folder (one writer at a time), writes
every file into a temporary folder beside the target (``.NAME.tmp-PID-RANDOM``), lists each
file's size and SHA-256 in ``manifest.json`` (written last), and swaps the folder in with one
atomic ``rename``: on Linux ``renameat2(RENAME_EXCHANGE)`` exchanges the two folders, then the
old one is removed; elsewhere the old folder is renamed aside first (put back if the second
rename fails). A failure anywhere before the swap (an unreadable image, a file name that is not
UTF-8, Ctrl-C) removes the temporary folder and leaves the old index byte-identical; a process
killed outright leaves a ``.NAME.tmp-PID-*`` folder that the next writer removes once that PID
is gone. Images an index already owns (``images/``) are carried into the new folder as hard
links (copies where links fail), so they cost no space and the old files are not modified.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import secrets
import shutil
import stat
from pathlib import Path

from deepmetric.data.files import file_digest

__all__ = ["index_transaction", "swap_in", "carry_file", "file_sha256", "file_entries", "write_file",
           "check_utf8", "check_listed_names", "check_inside", "plain_file", "verify_files", "files_error", "IndexFilesError",
           "IndexBusyError"]


class IndexFilesError(ValueError):
    """An index folder whose files do not match its manifest."""


class IndexBusyError(OSError):
    """Another process holds the lock for writing an index in the same folder."""


def file_sha256(path: str | Path) -> str:
    return file_digest(path).hexdigest()


def check_utf8(text: str, what: str) -> None:
    """ValueError naming ``text`` (shown with its undecodable bytes escaped) when it cannot be
    written as UTF-8: a file name that is not UTF-8 arrives from the OS with lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(text).decode("utf-8", "backslashreplace")
        raise ValueError(f"{what} {shown!s} is not valid UTF-8 (bytes {os.fsencode(text)!r}); rename it: "
                         "index files store names and paths as UTF-8 JSON") from None


# --------------------------------------------------------------------------- swapping
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2_exchange(a: Path, b: Path) -> bool:
    """Atomically exchange ``a`` and ``b`` (Linux renameat2); False where not available."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # kernel or file system without RENAME_EXCHANGE
    raise OSError(err, f"cannot swap {a} into {b}: {os.strerror(err)}")


def swap_in(new: Path, target: Path) -> None:
    """Put folder ``new`` at ``target`` atomically and remove what was there."""
    if not target.exists():
        os.rename(new, target)
        return
    if target.is_dir() and _renameat2_exchange(new, target):
        shutil.rmtree(new)  # ``new`` now holds the old folder
        return
    aside = new.with_name(new.name + "-old")
    os.rename(target, aside)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(target: Path) -> None:
    """Temporary folders of writers of ``target`` that were killed outright (and a symbolic link
    left by an older deepmetric's swap through a linked ``--out``)."""
    prefix = f".{target.name}.tmp-"
    for p in target.parent.glob(prefix + "*"):
        pid = p.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            if p.is_symlink():
                p.unlink()
            else:
                shutil.rmtree(p, ignore_errors=True)


_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


@contextlib.contextmanager
def _parent_lock(parent: Path):
    """An exclusive ``flock`` on the parent folder: one index writer at a time (no lock file)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(parent, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise IndexBusyError(f"another process is writing an index in {parent}; wait for it "
                                 "to finish") from None
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def index_transaction(target: str | Path):
    """Yield a new empty temporary folder beside ``target``; when the block ends without an
    error it replaces ``target`` atomically, otherwise it is removed.

    A ``target`` that is a symbolic link (or lies below one) is resolved first: the folder the
    link points to is replaced and the link keeps pointing at it. A full disk (ENOSPC / EDQUOT)
    is an OSError saying so and that the old index is unchanged."""
    target = Path(target).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _parent_lock(target.parent):
        _remove_stale(target)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            yield tmp
            swap_in(tmp, target)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
                kept = "the index there is unchanged" if target.exists() else "nothing was written"
                raise OSError(exc.errno, f"no space left on the device while writing the index {target} "
                                         f"({exc.strerror or exc}); {kept}. Free some space and run the "
                                         "command again") from None
            raise


def write_file(path: Path, data) -> None:
    """Write ``data`` (bytes or a buffer such as a numpy array) to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(memoryview(data).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def carry_file(src: Path, dst: Path) -> None:
    """``dst`` becomes the same file as ``src``: a hard link, or a copy where links fail. A
    missing ``src`` is named as the index's image it is: an index written before version 2
    lists no files, so nothing noticed it was gone until the index was rewritten."""
    if not src.is_file():
        raise FileNotFoundError(f"image {src} of the index is missing: an index keeps the images inside its folder "
                                "and carries each one along when it is rewritten, so each must be there; restore it, "
                                "or rebuild the index with 'deepmetric index ... --overwrite' (the index was not "
                                "changed)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


# --------------------------------------------------------------------------- manifest entries
def file_entries(folder: Path) -> dict[str, dict]:
    """``{relative path: {"bytes", "sha256"}}`` of every file below ``folder`` except the
    manifest, sorted by path."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            out[p.relative_to(folder).as_posix()] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
    return out


def check_listed_names(folder: Path, files) -> None:
    """The manifest's ``files`` is a mapping of plain relative paths below ``folder`` (no
    absolute path, no ``..``, no manifest.json) with integer sizes: checked before any listed
    file is opened, so a tampered manifest cannot make the loader touch files outside."""
    where = f"{folder / 'manifest.json'}: 'files'"
    if not isinstance(files, dict):
        raise IndexFilesError(f"{where} must map file names to {{bytes, sha256}}, got {type(files).__name__}")
    for rel, entry in files.items():
        parts = rel.replace("\\", "/").split("/") if isinstance(rel, str) else []
        if (not parts or os.path.isabs(rel) or rel.startswith("\\") or rel == "manifest.json"
                or any(p in ("", ".", "..") for p in parts)):
            raise IndexFilesError(f"{where} lists {rel!r}, which is not a file inside the index folder; "
                                  "the manifest was edited or damaged. Rebuild it with 'deepmetric index ... "
                                  "--overwrite'")
        if (not isinstance(entry, dict) or isinstance(entry.get("bytes"), bool)
                or not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("sha256"), str)):
            raise IndexFilesError(f"{where}[{rel!r}] must be {{bytes: INT, sha256: HEX}}, got {entry!r}")


def check_inside(rel_paths, what: str) -> None:
    """Relative paths stored in an index never climb out of its folder (the writer stores only
    paths below it as relative ones); ``what`` names the file that lists them."""
    for i, p in enumerate(rel_paths):
        if not isinstance(p, str):
            raise IndexFilesError(f"{what}: entry {i} is {type(p).__name__}, expected a path string")
        if p and not os.path.isabs(p) and ".." in p.replace("\\", "/").split("/"):
            raise IndexFilesError(f"{what}: entry {i} ({p!r}) leaves the index folder; relative image paths "
                                  "must lie inside it. Rebuild the index with 'deepmetric index ... --overwrite'")


def plain_file(folder: Path, rel: str) -> os.stat_result | str:
    """The ``lstat`` of ``folder/rel`` when it is a regular file reached without following a
    symbolic link (a writer only ever stores plain files), else what is wrong with it."""
    cur = folder
    for part in rel.split("/"):
        cur = cur / part
        try:
            st = os.lstat(cur)
        except (FileNotFoundError, NotADirectoryError):
            return "missing"
        if stat.S_ISLNK(st.st_mode):
            return "is a symbolic link (an index holds plain files)"
    return st if stat.S_ISREG(st.st_mode) else "not a regular file"


def verify_files(folder: Path, files: dict[str, dict], *, hashes: bool = False) -> None:
    """Every file of the manifest's ``files`` exists with its size (and, with ``hashes``, its
    SHA-256); IndexFilesError names the first files that do not."""
    bad = []
    for rel, entry in files.items():
        st = plain_file(folder, rel)
        if isinstance(st, str):
            bad.append(f"{rel}: {st}")
        elif st.st_size != entry["bytes"]:
            bad.append(f"{rel}: {st.st_size} bytes, the manifest says {entry['bytes']}")
        elif hashes and file_sha256(folder / rel) != entry["sha256"]:
            bad.append(f"{rel}: SHA-256 differs from the manifest's")
    if bad:
        raise files_error(folder, bad)


def files_error(folder: Path, bad: list[str]) -> IndexFilesError:
    more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
    return IndexFilesError(f"{folder}: files changed since the index was written: {'; '.join(bad[:5])}{more}. "
                           "Rebuild it with 'deepmetric index ... --overwrite'")
