"""Where the Files and Batch APIs keep their state (`batch_dir`): a local directory (a shared mount
such as NFS serves the replicas of several nodes), or any fsspec filesystem (`s3://`, `gs://`,
`az://`... with its fsspec package installed) where a cluster has no shared mount.

The two differ in what they can do, and the stores above use only what both can:
- `put` writes an object whole: a reader sees all of it or nothing (locally: a temporary file,
  fsync, rename; an object store's PUT is atomic by itself);
- `append` records one line of a journal, durable when it returns: locally appended to one file
  and fsynced; on an object store (no append) each line is an object of its own under the
  journal's prefix, read back in the order written;
- `lock` gives one process a key at a time: locally an OS file lock, given back by the OS when
  the process dies; on an object store a lease object renewed while it is held, which another
  process takes over once it has run out (a process that died leaves it for `LEASE_S`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

LEASE_S = 60.0  # how long a lease lasts without renewal: a dead holder's batch resumes elsewhere after it
LEASE_SETTLE_S = 0.5  # a lease is read back this long after it is written: of two writers, the last one holds it
LEFT_BY_A_CRASH_S = 3600  # a partial write this old was left by a crash (a live write takes far less)


class Lock(Protocol):
    def release(self) -> None: ...


class Storage:
    """Keys are `/`-separated paths below the root (`files/{id}/content`, `batches/{id}.json`)."""

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        """The object's bytes; FileNotFoundError when there is none."""
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        raise NotImplementedError

    def remove(self, key: str) -> None:
        """Remove the object (nothing when there is none)."""
        raise NotImplementedError

    def remove_folder(self, folder: str) -> None:
        """Remove `folder` and everything under it (nothing when there is none)."""
        raise NotImplementedError

    def age(self, key: str) -> float | None:
        """Seconds since `key` was last written; None when the store cannot say or there is none."""
        raise NotImplementedError

    def names(self, folder: str) -> list[str]:
        """The names directly under `folder` (objects and sub-folders), [] when there are none."""
        raise NotImplementedError

    def append(self, key: str, line: bytes) -> None:
        """Record `line` (ending in a newline) in the journal `key`, durably."""
        raise NotImplementedError

    def read_journal(self, key: str) -> bytes:
        """Every line recorded in the journal `key`, in order (b"" when there is none); a line a
        crash cut short is dropped."""
        raise NotImplementedError

    def remove_journal(self, key: str) -> None:
        raise NotImplementedError

    def lock(self, key: str) -> Lock | None:
        """The lock `key` if no other process holds it (release it when done), else None."""
        raise NotImplementedError


class LocalStorage(Storage):
    """A directory of this machine (or a mount every replica shares)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (NotADirectoryError, IsADirectoryError):
            raise FileNotFoundError(key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def remove(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def remove_folder(self, folder: str) -> None:
        path = self._path(folder)
        gone = path.with_name(f".gone-{path.name}-{secrets.token_hex(4)}")
        try:
            os.replace(path, gone)  # atomic: no reader sees a folder half removed
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    def age(self, key: str) -> float | None:
        try:
            return time.time() - self._path(key).stat().st_mtime
        except FileNotFoundError:
            return None

    def names(self, folder: str) -> list[str]:
        try:
            return [e.name for e in os.scandir(self._path(folder)) if not e.name.startswith(".")]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove_stale_temps(self, folder: str) -> None:
        """Temporary files (and folders) a crash left under `folder` an hour ago; never a write in progress."""
        directory = self._path(folder)
        for leftover in directory.rglob(".*") if directory.is_dir() else ():
            try:
                if time.time() - leftover.stat().st_mtime > LEFT_BY_A_CRASH_S:
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            except OSError:
                pass

    def append(self, key: str, line: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def read_journal(self, key: str) -> bytes:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return b""
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a last line without its newline: what a crash cut short
            with open(path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        return data[:end]

    def remove_journal(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def lock(self, key: str) -> Lock | None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")  # noqa: SIM115 (kept open while the lock is held)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        return _FileLock(f)


class _FileLock:
    def __init__(self, f: Any) -> None:
        self._f = f

    def release(self) -> None:
        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()


class FsspecStorage(Storage):
    """A folder of any fsspec filesystem (`url`: `s3://bucket/prefix`, ...)."""

    def __init__(self, url: str, lease_s: float | None = None, settle_s: float | None = None) -> None:
        import fsspec

        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.root = self.root.rstrip("/")
        self.lease_s = LEASE_S if lease_s is None else lease_s
        self.settle_s = LEASE_SETTLE_S if settle_s is None else settle_s
        self.holder = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"  # this process

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if not getattr(self.fs, "local_file", False):  # an object store's PUT: whole or nothing by itself
            self.fs.pipe_file(path, data)
            return
        # Files written in place (fsspec's local filesystem): a reader could see one half written,
        # so a temporary file is renamed in, in a folder made first.
        parent, name = path.rsplit("/", 1)
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{parent}/.{name}.{secrets.token_hex(4)}.tmp"
        self.fs.pipe_file(tmp, data)
        self.fs.mv(tmp, path)

    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except (IsADirectoryError, NotADirectoryError):
            raise FileNotFoundError(key) from None

    def exists(self, key: str) -> bool:
        return self.fs.exists(self._path(key))

    def remove(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    def remove_folder(self, folder: str) -> None:
        for name in self.names(folder):
            self.remove(f"{folder}/{name}")
        try:  # a filesystem with real folders keeps the empty one (an object store has none)
            self.fs.rmdir(self._path(folder))
        except (OSError, NotImplementedError):
            pass

    def age(self, key: str) -> float | None:
        try:
            modified = self.fs.modified(self._path(key))
        except (FileNotFoundError, NotImplementedError, IsADirectoryError):
            return None
        return time.time() - modified.timestamp()

    def names(self, folder: str) -> list[str]:
        try:
            entries = self.fs.ls(self._path(folder), detail=False, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except TypeError:  # a filesystem whose ls takes no `refresh` (it keeps no listing cache)
            try:
                entries = self.fs.ls(self._path(folder), detail=False)
            except (FileNotFoundError, NotADirectoryError):
                return []
        names = (str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries)
        return sorted(n for n in names if not n.startswith("."))  # not a write in progress

    def append(self, key: str, line: bytes) -> None:
        # No append on an object store: a line is an object under the journal's folder, named so
        # that names sort in the order written (time first; a random tail keeps two writers apart).
        self.put(f"{key}.d/{time.time_ns():020d}-{secrets.token_hex(4)}", line)

    def read_journal(self, key: str) -> bytes:
        folder = f"{key}.d"
        names = self.names(folder)
        if not names:
            return b""
        paths = [self._path(f"{folder}/{n}") for n in names]
        found = self.fs.cat(paths, on_error="omit")  # one call: fetched concurrently where the store can
        return b"".join(found[p] for p in paths if p in found)

    def remove_journal(self, key: str) -> None:
        self.remove_folder(f"{key}.d")

    def lock(self, key: str) -> Lock | None:
        lease = _Lease(self, key)
        return lease if lease.take() else None

    def read_lease(self, key: str) -> dict[str, Any] | None:
        try:
            return json.loads(self.get(key))
        except (FileNotFoundError, ValueError):
            return None


class _Lease:
    """A lease object `{holder, until}`: taken when there is none or it ran out, renewed by a thread
    every third of its length while held, removed when released."""

    def __init__(self, storage: FsspecStorage, key: str) -> None:
        self.storage, self.key = storage, key
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def _write(self) -> None:
        until = time.time() + self.storage.lease_s
        self.storage.put(self.key, json.dumps({"holder": self.storage.holder, "until": until}).encode())

    def _mine(self) -> bool:
        current = self.storage.read_lease(self.key)
        return current is not None and current.get("holder") == self.storage.holder

    def take(self) -> bool:
        current = self.storage.read_lease(self.key)
        if current is not None and float(current.get("until", 0)) > time.time():
            return False  # held, also when by this process (a cancel while it runs the batch), as a file lock is
        self._write()
        # Another process that saw the same run-out lease may have written too: the last write holds.
        time.sleep(self.storage.settle_s)
        if not self._mine():
            return False
        self._renewer = threading.Thread(target=self._renew, name=f"lease {self.key}", daemon=True)
        self._renewer.start()
        return True

    def _renew(self) -> None:
        while not self._stop.wait(self.storage.lease_s / 3):
            try:
                if not self._mine():
                    logger.warning("the lease %s was taken over by another process; this one goes on, and a "
                                   "request answered by both is recorded once", self.key)
                    return
                self._write()
            except Exception:  # noqa: BLE001 (the store unreachable for a while: tried again at the next renewal)
                logger.exception("could not renew the lease %s", self.key)

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        try:
            if self._mine():
                self.storage.remove(self.key)
        except Exception:  # noqa: BLE001 (it runs out by itself)
            logger.exception("could not remove the lease %s; it runs out in %.0f s", self.key, self.storage.lease_s)


def open_storage(where: str | Path | Storage) -> Storage:
    """A Storage for `batch_dir`: a path or `file://` URI is local; another URI goes through fsspec."""
    if isinstance(where, Storage):
        return where
    text = str(where)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return LocalStorage(text)
    if scheme == "file":
        return LocalStorage(rest)
    return FsspecStorage(text)


def check_url(url: str) -> None:
    """ValueError when `url`'s scheme has no fsspec filesystem installed here."""
    import fsspec

    scheme = url.partition("://")[0]
    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"batch_dir {url!r}: fsspec cannot open {scheme}:// here ({exc}); install the "
                         f"filesystem's package (for example s3fs for s3://, gcsfs for gs://)") from None
