"""Tiers hold payload bytes by location. They know nothing of rows, LRU or reservations (the index does).

Each tier still guards its own byte quota before writing, as a last line of defence: the index's
reservations already keep it under quota, so the guard only fires if the two ever disagree.

Fault injection (for tests and the fault suite): a callable assigned to `fault_hook` is called with the
tier's name after the first part of every write; an OSError it raises fails that write as a full or
failing device would.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

from barreld import paths

from .checkpoint import Buffer
from .errors import StoreLocked, TierWriteError

fault_hook: Callable[[str], None] | None = None

_SUFFIX = ".kvc"
BLOCK_SUFFIX = ".kvb"
_PUBLISHED = re.compile(r"^[0-9a-f]{64}\.kv[cb]$")
_TEMP_PREFIX = ".tmp-"
LOCK_NAME = ".lock"


def _inject_fault(tier: str) -> None:
    if fault_hook is not None:
        fault_hook(tier)


def _nbytes(parts: Iterable[Buffer]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


_read_buffers = threading.local()


def unexported(buf: bytearray) -> bool:
    """Whether no view of buf is alive: only then may it be resized, which this tries."""
    try:
        buf.append(0)
        buf.pop()
    except BufferError:
        return False
    return True


def thread_buffer(slot: threading.local, size: int) -> bytearray:
    """The calling thread's buffer kept in `slot`, grown to at least `size` bytes and reused while no view of
    it is alive (a fresh one otherwise, so earlier views stay intact): zero-filling a fresh buffer of tens of
    megabytes per read would cost more than the read."""
    buf = getattr(slot, "buf", None)
    if buf is None or len(buf) < size:
        buf = slot.buf = bytearray(size)
    elif not unexported(buf):
        buf = bytearray(size)
    return buf


class Tier(ABC):
    """A named byte store with a quota; `used` counts bytes it holds (or is writing)."""

    persistent: bool

    def __init__(self, name: str, quota: int) -> None:
        if quota < 0:
            raise ValueError(f"tier {name}: quota must be >= 0")
        self.name = name
        self.quota = quota
        self.used = 0
        self._sizes: dict[str, int] = {}  # payloads counted in `used`
        self._lock = threading.Lock()

    def _claim_bytes(self, n: int) -> None:
        """The quota guard: take n bytes of quota before writing any, or refuse."""
        with self._lock:
            if self.used + n > self.quota:
                raise TierWriteError(
                    self.name, errno.ENOSPC, f"write of {n} bytes would exceed the quota of {self.quota}"
                )
            self.used += n

    def _free_bytes(self, n: int) -> None:
        with self._lock:
            self.used -= n

    def forget(self, location: str) -> None:
        """Stop counting a payload's bytes: the index has dropped its row and `delete` removes them soon.

        The index calls this as it commits, so the quota guard agrees with the index at once while the
        (slower) delete runs outside the index's lock.
        """
        with self._lock:
            self.used -= self._sizes.pop(location, 0)

    @abstractmethod
    def put(
        self, name: str, parts: list[Buffer], claim_ok: Callable[[], bool] | None = None, *, block: bool = False
    ) -> str | None:
        """Store a payload (a row's, or with `block` a block's) under `name`; None when `claim_ok` says the
        reservation was lost."""

    @abstractmethod
    def read(self, location: str) -> bytearray | memoryview:
        """The whole payload at a location (OSError/KeyError when it is gone)."""

    def read_range(self, location: str, start: int, end: int) -> bytes:
        """Bytes start..end of a payload (OSError/KeyError when it is gone)."""
        return bytes(self.read(location)[start:end])

    @abstractmethod
    def delete(self, location: str) -> None:
        """Remove a payload; removing one that is already gone is not an error."""

    @abstractmethod
    def size(self, location: str) -> int | None:
        """The payload's size in bytes, or None when it does not exist."""

    @abstractmethod
    def scan(self) -> dict[str, int]:
        """Every published payload: location -> size."""

    def block_location(self, name: str) -> str:
        """Where a block named `name` (its key hex) is stored."""
        return f"{name}{BLOCK_SUFFIX}"

    def exists(self, location: str) -> bool:
        """Whether a payload is stored at the location."""
        return self.size(location) is not None


class RamTier(Tier):
    """Payloads in anonymous memory maps: deleting one returns its pages to the OS at once."""

    persistent = False

    def __init__(self, quota: int, name: str = "ram") -> None:
        super().__init__(name, quota)
        self._maps: dict[str, tuple[mmap.mmap, int]] = {}

    def put(
        self, name: str, parts: list[Buffer], claim_ok: Callable[[], bool] | None = None, *, block: bool = False
    ) -> str | None:
        """Copy the parts into a fresh anonymous map; the location is the name (a block's, with its suffix)."""
        name = self.block_location(name) if block else name
        n = _nbytes(parts)
        self._claim_bytes(n)
        m = None
        stored = False
        try:
            m = mmap.mmap(-1, max(n, 1))
            for i, part in enumerate(parts):
                m.write(part)
                if i == 0:
                    _inject_fault(self.name)
            if claim_ok is not None and not claim_ok():
                return None
            with self._lock:
                old = self._maps.pop(name, None)
                self.used -= self._sizes.pop(name, 0)
                self._maps[name] = (m, n)
                self._sizes[name] = n
            stored = True
        except OSError as e:
            raise TierWriteError(self.name, e.errno, str(e)) from e
        finally:
            if not stored:
                if m is not None:
                    m.close()
                self._free_bytes(n)
        if old is not None:
            _unmap(old[0])
        return name

    def read(self, location: str) -> memoryview:
        """A zero-copy view of the payload (valid while the row is referenced)."""
        with self._lock:
            m, n = self._maps[location]
        return memoryview(m)[:n]

    def delete(self, location: str) -> None:
        """Unmap the payload; if a reader still holds a view, the pages go when the view does."""
        with self._lock:
            entry = self._maps.pop(location, None)
        self.forget(location)
        if entry is not None:
            _unmap(entry[0])

    def size(self, location: str) -> int | None:
        with self._lock:
            return self._sizes.get(location)

    def scan(self) -> dict[str, int]:
        with self._lock:
            return dict(self._sizes)

    def close(self) -> None:
        """Drop every payload (ram rows do not outlive the process)."""
        with self._lock:
            locations = list(self._maps)
        for location in locations:
            self.delete(location)


def _unmap(m: mmap.mmap) -> None:
    # While a reader still holds a view the map cannot close; it is freed with the last view.
    with contextlib.suppress(BufferError):
        m.close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fill(f: BinaryIO, view: memoryview, location: str) -> None:
    """Read exactly len(view) bytes of an open file into view."""
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise OSError(errno.EIO, f"{location} shrank while being read")
        got += n


def _write_all(fd: int, parts: list[Buffer], tier: str) -> None:
    for i, part in enumerate(parts):
        mv = memoryview(part).cast("B")
        while mv:
            mv = mv[os.write(fd, mv) :]
        if i == 0:
            _inject_fault(tier)


class FileTier(Tier):
    """Payloads as files `<key hex>.kvc` (rows) and `<key hex>.kvb` (blocks) in one private directory (0700,
    files 0600)."""

    persistent = True

    def __init__(self, name: str, root: Path, quota: int) -> None:
        super().__init__(name, quota)
        self.root = Path(root).absolute()
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = self.root.stat()
        if st.st_uid != os.getuid():
            raise PermissionError(f"tier {name}: {self.root} is owned by uid {st.st_uid}, not us")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(self.root, 0o700)
        self._prefix = os.path.join(str(self.root), "")
        # The one scan of the directory at open: sizes of the files we know (so a file removed behind our
        # back still frees its quota), and the temp files of writers that were running before we opened.
        self._sizes, self._found_temps = self._scan()
        self.used = sum(self._sizes.values())
        self._lock_fd: int | None = None

    def lock(self) -> None:
        """Take this directory for our process alone: two daemons must never reconcile one root."""
        self._lock_fd = hold_lock(self.root / LOCK_NAME, f"tier {self.name}: {self.root}")

    def unlock(self) -> None:
        """Release the directory lock (closing the descriptor drops the flock)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def location_for(self, name: str) -> str:
        """Where a payload named `name` (its key hex) is published."""
        return f"{self._prefix}{name}{_SUFFIX}"

    def block_location(self, name: str) -> str:
        return f"{self._prefix}{name}{BLOCK_SUFFIX}"

    def location_parts(self) -> tuple[str, str]:
        """What comes before and after a payload's name in its location."""
        return self._prefix, _SUFFIX

    def _check_location(self, location: str) -> str:
        head, name = os.path.split(location)
        if os.path.join(head, "") != self._prefix or not _PUBLISHED.match(name):
            raise ValueError(f"tier {self.name}: {location} is not a location of this tier")
        return location

    def publish(
        self, name: str, parts: list[Buffer], claim_ok: Callable[[], bool], *, block: bool = False
    ) -> str | None:
        """Crash-safe publish: temp file, fdatasync, confirm the claim, rename into place, fsync the dir.

        A crash at any point leaves either no published file or a complete, durable one; temp files
        are removed by `cleanup_temps` on the next start. Any I/O error raises TierWriteError and
        leaves no temp file behind.
        """
        n = _nbytes(parts)
        self._claim_bytes(n)
        tmp = self.root / f"{_TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        final = Path(self.block_location(name) if block else self.location_for(name))
        moved = published = False
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, parts, self.name)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            if not claim_ok():
                return None
            os.replace(tmp, final)
            moved = True
            _fsync_dir(self.root)
            published = True
        except OSError as e:
            raise TierWriteError(self.name, e.errno, f"publishing {final.name}: {e.strerror or e}") from e
        finally:
            if not published:
                (final if moved else tmp).unlink(missing_ok=True)
                self._free_bytes(n)
        with self._lock:
            replaced = self._sizes.get(str(final), 0)
            self._sizes[str(final)] = n
            self.used -= replaced
        return str(final)

    def put(
        self, name: str, parts: list[Buffer], claim_ok: Callable[[], bool] | None = None, *, block: bool = False
    ) -> str | None:
        """`publish`, with a claim that always holds when none is given."""
        return self.publish(name, parts, claim_ok or (lambda: True), block=block)

    def read(self, location: str) -> memoryview:
        """The whole file, read into this thread's reusable buffer (no intermediate copies).

        Allocating and zero-filling a fresh state-sized buffer per restore would cost more than reading the
        file, so each thread keeps one buffer, grown as needed, and reuses it once no view of it is alive.
        """
        path = self._check_location(location)
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            view = memoryview(thread_buffer(_read_buffers, size))[:size]
            _fill(f, view, location)
        return view

    def read_range(self, location: str, start: int, end: int) -> bytes:
        """Only the bytes asked for: a row's text without the state after it."""
        with open(self._check_location(location), "rb", buffering=0) as f:
            return os.pread(f.fileno(), max(0, end - start), start)

    def read_into(self, location: str, out: memoryview) -> int:
        """Read a whole file into `out` (at least its size); returns its size."""
        with open(self._check_location(location), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size > len(out):
                raise OSError(errno.EIO, f"{location} is {size} bytes, more than the {len(out)} expected")
            _fill(f, out[:size], location)
        return size

    def delete(self, location: str) -> None:
        """Unlink the file (the index has already committed its removal)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._check_location(location))
        self.forget(location)

    def sync(self) -> None:
        """Make the directory's changes durable (deletions: a published file is synced as it is renamed)."""
        _fsync_dir(self.root)

    def size(self, location: str) -> int | None:
        try:
            return os.stat(self._check_location(location)).st_size
        except (FileNotFoundError, ValueError):
            return None

    def scan(self) -> dict[str, int]:
        return self._scan()[0]

    def _scan(self) -> tuple[dict[str, int], list[Path]]:
        """One pass over the directory: published payloads (location -> size) and temp files."""
        published, temps = {}, []
        with os.scandir(self.root) as it:
            for entry in it:
                if _PUBLISHED.match(entry.name):
                    try:
                        published[self._prefix + entry.name] = entry.stat().st_size
                    except FileNotFoundError:
                        continue
                elif entry.name.startswith(_TEMP_PREFIX):
                    temps.append(self.root / entry.name)
        return published, temps

    def sizes(self) -> dict[str, int]:
        """The payloads this tier counts (location -> size): at open, what its one scan found."""
        with self._lock:
            return dict(self._sizes)

    def temps(self) -> list[Path]:
        """Temp files in the directory (a writer's, or a dead writer's leftovers)."""
        return [self.root / n for n in os.listdir(self.root) if n.startswith(_TEMP_PREFIX)]

    def cleanup_temps(self) -> int:
        """Remove the temp files found when the tier was opened: writers dead before we took the directory.

        Temp files that appear later belong to our own writers and are left alone.
        """
        removed = 0
        found, self._found_temps = self._found_temps, []
        for path in found:
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                continue
        return removed


def hold_lock(path: Path, what: str) -> int:
    """The descriptor holding `path`'s lock (see `barreld.paths.lock_file`); StoreLocked while another process
    holds it."""
    fd = paths.lock_file(path, wait=False)
    if fd is None:
        raise StoreLocked(f"{what} is in use by another process")
    return fd
