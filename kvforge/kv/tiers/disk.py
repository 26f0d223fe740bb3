"""Disk tier: one content-addressed file per KV block. Pure Python (bytes and files, no torch).

File = magic, format version, a JSON header (namespace, key, the block's token ids,
payload length, SHA-256 of the payload), then the payload: the block's bytes for
every layer as `block_io` lays them out. A file that fails any check (truncated,
flipped bytes, another model's namespace, other tokens) is a miss and is deleted,
so a bad file never becomes wrong KV.

Writes go through a temporary file and `os.replace`, which is atomic on POSIX:
two processes sharing a directory never read a partial file. The size bound is an
LRU by access time: a hit touches the file (`os.utime`, explicit because many
disks mount noatime), start-up scans the directory oldest first. Each process
bounds the files it knows; another process's new files are found on lookup.

Writes run on one background thread so a step never waits for the disk; a block
whose write is still queued is served from memory. Blocks are written through as
they become cached (KVTiers.write_through), within `write_budget` bytes queued, so
a plain script that exits without `close()` or a SIGKILLed server keeps its
prefixes (docs/security.md has the measurement behind this choice). A killed
writer leaves at most a temporary file, never a partial `.kvb`; a temporary file
whose writer process is gone is removed at the next start-up.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
import uuid
from collections.abc import Sequence
from typing import cast

from kvforge.kv.tiers.keys import FORMAT_VERSION
from kvforge.kv.tiers.lru import LRUIndex

MAGIC = b"KVFORGE-KVB\x00"
_FIXED = struct.Struct("<II")  # version, header length
SUFFIX = ".kvb"
TMP_MARK = ".tmp-"  # `<key>.kvb.tmp-<pid>-<random>` while a write is in flight
DEFAULT_WRITE_BUDGET = 64 << 20  # bytes queued for the writer before write-through skips blocks


def check_directory(path: str, flag: str = "kv_disk_cache") -> str:
    """Create `path` if needed and prove it writable; ValueError names the flag otherwise."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe-{os.getpid()}-{uuid.uuid4().hex}")
        with open(probe, "wb") as f:
            f.write(b"x")
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"{flag}: directory {path!r} is not writable ({exc.strerror or exc})") from None
    return path


def encode_file(namespace: bytes, key: bytes, token_ids: Sequence[int], payload: bytes) -> bytes:
    header = json.dumps({"namespace": namespace.hex(), "key": key.hex(), "tokens": list(token_ids),
                         "payload_len": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}).encode()
    return MAGIC + _FIXED.pack(FORMAT_VERSION, len(header)) + header + payload


def decode_file(blob: bytes, namespace: bytes, key: bytes, token_ids: Sequence[int]) -> bytes | None:
    """The payload if `blob` is an intact file for exactly this namespace, key and tokens, else None."""
    fixed_end = len(MAGIC) + _FIXED.size
    if len(blob) < fixed_end or blob[: len(MAGIC)] != MAGIC:
        return None
    version, header_len = _FIXED.unpack_from(blob, len(MAGIC))
    if version != FORMAT_VERSION or fixed_end + header_len > len(blob):
        return None
    try:
        header = json.loads(blob[fixed_end : fixed_end + header_len])
    except ValueError:
        return None
    payload = blob[fixed_end + header_len :]
    ok = (isinstance(header, dict) and header.get("namespace") == namespace.hex() and header.get("key") == key.hex()
          and header.get("tokens") == list(token_ids) and header.get("payload_len") == len(payload)
          and header.get("sha256") == hashlib.sha256(payload).hexdigest())
    return payload if ok else None


class DiskTier:
    name = "disk"

    def __init__(self, directory: str, capacity_bytes: int, namespace: bytes, background: bool = True,
                 write_budget: int = DEFAULT_WRITE_BUDGET) -> None:
        self.directory = check_directory(directory)
        self.namespace = namespace
        self.index: LRUIndex[None] = LRUIndex(capacity_bytes)
        self.lock = threading.Lock()
        self.pending: dict[bytes, tuple[tuple[int, ...], bytes]] = {}  # queued writes, served from memory
        self.write_budget = write_budget  # write-through stops queueing past this many bytes (0: off)
        self.queued_bytes = 0  # payload bytes in `pending`
        self.bytes_written = self.bytes_read = self.num_corrupt = 0
        self._scan()
        self.queue: queue.Queue[bytes | None] | None = None
        if background:
            self.queue = queue.Queue()
            self.thread = threading.Thread(target=self._writer, name="kvforge-disk-tier", daemon=True)
            self.thread.start()

    @property
    def capacity(self) -> int:
        return self.index.capacity

    @property
    def used(self) -> int:
        return self.index.used

    def path(self, key: bytes) -> str:
        h = key.hex()
        return os.path.join(self.directory, h[:2], h + SUFFIX)

    def _scan(self) -> None:
        """Index the files already there, oldest access first (a restart keeps its LRU order)."""
        found = []
        for root, _, files in os.walk(self.directory):
            for name in files:
                full = os.path.join(root, name)
                if TMP_MARK in name and _writer_gone(name):
                    self._unlink(full)  # a write its process never finished (killed): never a .kvb
                elif name.endswith(SUFFIX):
                    try:
                        st = os.stat(full)
                    except OSError:
                        continue
                    found.append((max(st.st_atime, st.st_mtime), bytes.fromhex(name[: -len(SUFFIX)]), st.st_size))
        for _, key, size in sorted(found):
            self._admit(key, size)

    def _admit(self, key: bytes, size: int) -> bool:
        """Make room for and index a file of `size` bytes (deleting evicted files)."""
        with self.lock:
            if key in self.index:
                self.index.get(key)
                return True
            evicted = self.index.make_room(size)
            if evicted is None:
                return False
            self.index.add(key, None, size)
        for old, _ in evicted:
            self._unlink(self.path(cast(bytes, old)))
        return True

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.remove(path)
        except OSError:
            pass

    def contains(self, key: bytes) -> bool:
        return key in self.pending or key in self.index or os.path.exists(self.path(key))

    def get(self, key: bytes, token_ids: Sequence[int]) -> bytes | None:
        """The block's payload, verified; a bad file is deleted and reads as a miss."""
        queued = self.pending.get(key)
        if queued is not None:
            return queued[1] if queued[0] == tuple(token_ids) else None
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except OSError:
            with self.lock:
                self.index.remove(key)
            return None
        payload = decode_file(blob, self.namespace, key, token_ids)
        if payload is None:
            self.num_corrupt += 1
            with self.lock:
                self.index.remove(key)
            self._unlink(path)
            return None
        self.bytes_read += len(blob)
        try:
            os.utime(path)  # LRU by access time, shared with other processes
        except OSError:
            pass
        self._admit(key, len(blob))
        return payload

    def put(self, key: bytes, token_ids: Sequence[int], payload: bytes) -> None:
        """Store a block (asynchronously when a writer thread runs); an existing file is only touched."""
        if key in self.pending:
            return
        if key in self.index and os.path.exists(self.path(key)):
            with self.lock:
                self.index.get(key)
            return
        if self.queue is None:
            self._write(key, tuple(token_ids), payload)
            return
        with self.lock:
            self.pending[key] = (tuple(token_ids), payload)
            self.queued_bytes += len(payload)
        self.queue.put(key)

    def _writer(self) -> None:
        assert self.queue is not None
        while True:
            key = self.queue.get()
            if key is None:
                self.queue.task_done()
                return
            item = self.pending.get(key)
            try:
                if item is not None:
                    self._write(key, *item)
            finally:
                with self.lock:
                    done = self.pending.pop(key, None)
                    self.queued_bytes -= len(done[1]) if done is not None else 0
                self.queue.task_done()

    def _write(self, key: bytes, token_ids: tuple[int, ...], payload: bytes) -> None:
        blob = encode_file(self.namespace, key, token_ids, payload)
        if not self._admit(key, len(blob)):
            return  # larger than the whole tier
        path = self.path(key)
        tmp = f"{path}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # atomic: readers see the old file, no file, or the whole new one
            self.bytes_written += len(blob)
        except OSError:
            self._unlink(tmp)
            with self.lock:
                self.index.remove(key)

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        if self.queue is not None:
            self.queue.join()

    def close(self) -> None:
        if self.queue is not None:
            self.flush()
            self.queue.put(None)
            self.thread.join(timeout=10)
            self.queue = None


def _writer_gone(name: str) -> bool:
    """Whether the process that named this temporary file has exited (so the file is abandoned)."""
    try:
        pid = int(name.split(TMP_MARK, 1)[1].split("-", 1)[0])
        os.kill(pid, 0)
    except (ValueError, IndexError):
        return True  # not a name this tier writes
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    return False  # its writer still runs (a live process, or a pid reused: the file is kept)


def measure_read_bandwidth(directory: str, nbytes: int) -> float:
    """Bytes per second of writing then reading and verifying one probe file of `nbytes` (start-up ledger).

    It goes through the same encode/decode as a block, so the figure includes the checksum; a probe just
    written is usually read from the page cache, as a recently evicted block would be.
    """
    import time

    payload = os.urandom(nbytes)
    ns, key = b"probe", hashlib.sha256(payload[:64]).digest()
    path = os.path.join(directory, f".probe-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        with open(path, "wb") as f:
            f.write(encode_file(ns, key, (), payload))
        start = time.perf_counter()
        with open(path, "rb") as f:
            ok = decode_file(f.read(), ns, key, ()) is not None
        elapsed = max(time.perf_counter() - start, 1e-9)
    finally:
        DiskTier._unlink(path)
    assert ok, "disk tier probe did not read back"
    return nbytes / elapsed
