"""Disk tier: LRU and cap, restart, atomic writes, crash leftovers, damaged files, full or unwritable disk,
a deleted directory, a filesystem smaller than the cap."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hafiza.store.config import DEFAULT_DISK_BYTES
from hafiza.store.disk import TMP_PREFIX, DiskStore
from hafiza.store.frame import HEADER

VALUE = 1000
FRAMED = HEADER.size + len("k0") + VALUE  # file size of a key of 2 chars holding VALUE bytes


def files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != ".lock")


def test_lru_evicts_least_recent_under_the_cap(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, capacity_bytes=3 * FRAMED)
    for k in ("k0", "k1", "k2"):
        assert store.put(k, b"x" * VALUE)
    store.get("k0")  # k1 is now least recent
    assert store.put("k3", b"x" * VALUE)
    assert [store.contains(k) for k in ("k0", "k1", "k2", "k3")] == [True, False, True, True]
    s = store.stats()
    assert (s.entries, s.bytes, s.evictions) == (3, 3 * FRAMED, 1)
    assert len(files(tmp_path)) == 3


def test_value_larger_than_cap_is_rejected_not_an_error(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, capacity_bytes=100)
    assert store.put("big", b"x" * 200) is False
    zero = DiskStore(tmp_path / "zero", capacity_bytes=0)
    assert zero.put("k", b"") is False
    assert (store.stats().rejected, store.stats().errors) == (1, 0)
    assert store.enabled and zero.enabled


def test_survives_restart_with_lru_order(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, capacity_bytes=3 * FRAMED)
    for k in ("k0", "k1", "k2"):
        store.put(k, k.encode() * (VALUE // 2))
    store.get("k0")
    store.close()

    again = DiskStore(tmp_path, capacity_bytes=3 * FRAMED)
    assert again.stats().entries == 3 and again.stats().bytes == 3 * FRAMED
    assert again.get("k2") == b"k2" * (VALUE // 2)
    again.put("k3", b"x" * VALUE)  # least recent now: k1 (k0 and k2 were read)
    assert [again.contains(k) for k in ("k0", "k1", "k2", "k3")] == [True, False, True, True]


def test_restart_with_smaller_cap_evicts_oldest(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, capacity_bytes=10 * FRAMED)
    for i in range(4):
        store.put(f"k{i}", b"x" * VALUE)
    store.close()
    small = DiskStore(tmp_path, capacity_bytes=2 * FRAMED)
    assert [small.contains(f"k{i}") for i in range(4)] == [False, False, True, True]
    assert len(files(tmp_path)) == 2


def test_second_store_on_same_directory_is_disabled(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = DiskStore(tmp_path, capacity_bytes=1 << 20)
    with caplog.at_level(logging.ERROR, logger="hafiza.store"):
        second = DiskStore(tmp_path, capacity_bytes=1 << 20)
    assert not second.enabled and second.put("k", b"v") is False
    assert "in use by another store" in caplog.text
    first.close()


def test_leftover_temp_file_is_ignored_and_removed(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, capacity_bytes=1 << 20)
    store.put("kept", b"v" * 100)
    final = store.path_of("kept")
    store.close()
    crash = final.parent / f"{TMP_PREFIX}{final.stem}-999-0"
    crash.write_bytes(b"half a write")
    foreign = tmp_path / "notes.txt"
    foreign.write_text("not ours")

    again = DiskStore(tmp_path, capacity_bytes=1 << 20)
    assert again.removed_temp_files == 1 and not crash.exists()
    assert again.stats().entries == 1 and again.get("kept") == b"v" * 100
    assert foreign.exists()


def test_readers_never_see_a_partial_file(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, capacity_bytes=64 << 20)
    a, b = b"a" * 300_000, b"b" * 200_000
    store.put("hot", a)
    seen: list[bytes | None] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            seen.append(store.get("hot"))

    th = threading.Thread(target=reader)
    th.start()
    for i in range(150):
        store.put("hot", a if i % 2 else b)
    stop.set()
    th.join()
    assert seen and all(v in (a, b) for v in seen)
    assert store.stats().errors == 0
    assert not [p for p in tmp_path.rglob(f"{TMP_PREFIX}*")]


@pytest.mark.parametrize(
    "damage",
    ["flip-payload", "flip-header", "flip-checksum", "truncate", "append", "empty"],
)
def test_damaged_file_is_detected_and_dropped(tmp_path: Path, damage: str) -> None:
    store = DiskStore(tmp_path, capacity_bytes=1 << 20)
    store.put("k", os.urandom(4096))
    path = store.path_of("k")
    data = bytearray(path.read_bytes())
    if damage == "flip-payload":
        data[len(data) // 2] ^= 0x01
    elif damage == "flip-header":
        data[5] ^= 0x80  # the reserved flags byte
    elif damage == "flip-checksum":
        data[16] ^= 0xFF
    elif damage == "truncate":
        data = data[:-100]
    elif damage == "append":
        data += b"\0"
    else:
        data = bytearray()
    path.write_bytes(bytes(data))

    assert store.get("k") is None
    s = store.stats()
    assert (s.errors, s.misses, s.hits, s.entries, s.bytes) == (1, 1, 0, 0, 0)
    assert not path.exists() and not store.contains("k")
    assert store.put("k", b"recomputed") and store.get("k") == b"recomputed"


def test_file_removed_behind_the_store_is_a_miss(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, capacity_bytes=1 << 20)
    store.put("k", b"v")
    store.path_of("k").unlink()
    assert store.get("k") is None
    assert store.stats().errors == 0 and store.stats().entries == 0


def test_directory_under_a_regular_file_disables_the_tier(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with caplog.at_level(logging.ERROR, logger="hafiza.store"):
        store = DiskStore(blocker / "kv", capacity_bytes=1 << 20)
        assert store.put("k", b"v") is False
        assert store.put("k2", b"v") is False
    assert not store.enabled and not store.stats().enabled
    assert store.get("k") is None and store.contains("k") is False
    lines = [r for r in caplog.records if "disabled" in r.getMessage()]
    assert len(lines) == 1 and "serving continues" in lines[0].getMessage()


def test_directory_made_unwritable_mid_run_disables_then_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "kv"
    store = DiskStore(root, capacity_bytes=1 << 20, retry_after_s=0.0)
    assert store.put("before", b"v")
    shard = store.path_of("after").parent
    shutil.rmtree(shard, ignore_errors=True)
    shard.write_text("a regular file where the shard directory was")  # as root, chmod would not stop us
    with caplog.at_level(logging.WARNING, logger="hafiza.store"):
        assert store.put("after", b"v") is False
        assert not store.enabled
        assert store.put("after", b"v") is False  # the retry fails again, quietly
        shard.unlink()
        assert store.put("after", b"v") is True  # the retry succeeds: the tier is back
    assert store.enabled and store.get("after") == b"v"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("disabled" in m for m in messages) == 1
    assert sum("re-enabled" in m for m in messages) == 1
    assert store.stats().errors == 2


def test_full_disk_disables_the_tier_and_leaves_no_partial_file(tmp_path: Path) -> None:
    """A real short write: the file-size limit (RLIMIT_FSIZE, enforced even for root) makes write() fail."""
    script = textwrap.dedent(
        """
        import json, logging, resource, signal, sys
        from pathlib import Path
        from hafiza.store.disk import DiskStore
        logging.basicConfig(level=logging.ERROR, format="%(message)s")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        root = Path(sys.argv[1])
        store = DiskStore(root, capacity_bytes=1 << 30)
        small = store.put("small", b"s" * 1000)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
        big = store.put("big", b"b" * (1 << 20))
        again = store.put("big2", b"b" * (1 << 20))
        print(json.dumps({
            "small": small, "big": big, "again": again, "enabled": store.enabled,
            "small_back": store.get("small") == b"s" * 1000, "errors": store.stats().errors,
            "files": sorted(p.name for p in root.rglob("*") if p.is_file()),
        }))
        """
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert result["small"] is True and result["big"] is False and result["again"] is False
    assert result["enabled"] is False and result["small_back"] is True and result["errors"] == 1
    assert len(result["files"]) == 2  # the lock and "small": no temp file, no partial "big"
    assert out.stderr.count("disabled") == 1 and "File too large" in out.stderr


def test_directory_deleted_mid_run_is_recreated_and_serving_continues(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "kv"
    store = DiskStore(root, capacity_bytes=1 << 20, check_interval_s=3600.0)  # only a failed write notices
    assert store.put("a", b"va") and store.put("b", b"vb")
    shutil.rmtree(root)
    with caplog.at_level(logging.WARNING, logger="hafiza.store"):
        assert store.put("c", b"vc") is True  # the write finds the directory gone, recreates it, retries
        assert store.put("d", b"vd") is True
    assert store.enabled and store.get("c") == b"vc" and store.get("d") == b"vd"
    assert store.get("a") is None and not store.contains("b")  # the deleted entries are forgotten
    s = store.stats()
    assert (s.entries, s.errors) == (2, 0)
    assert (root / ".lock").is_file() and len(files(root)) == 2
    messages = [r.getMessage() for r in caplog.records]
    assert sum("deleted or replaced" in m for m in messages) == 1
    assert not any("disabled" in m for m in messages)
    store.close()


def test_lock_survives_the_directory_being_deleted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "kv"
    store = DiskStore(root, capacity_bytes=1 << 20, check_interval_s=0.0)
    assert store.put("a", b"va")
    shutil.rmtree(root)
    assert store.contains("a") is False  # a read notices: entries forgotten, directory and lock recreated
    with caplog.at_level(logging.ERROR, logger="hafiza.store"):
        second = DiskStore(root, capacity_bytes=1 << 20)
    assert not second.enabled and "in use by another store" in caplog.text
    assert store.put("b", b"vb") and store.get("b") == b"vb"
    second.close()
    store.close()


def test_directory_taken_over_after_deletion_disables_the_old_store(tmp_path: Path) -> None:
    """Whoever locks the recreated directory first owns it; the other store steps aside."""
    root = tmp_path / "kv"
    old = DiskStore(root, capacity_bytes=1 << 20, check_interval_s=0.0)
    assert old.put("a", b"va")
    shutil.rmtree(root)
    new = DiskStore(root, capacity_bytes=1 << 20)
    assert new.enabled and new.put("n", b"vn")
    assert old.put("b", b"vb") is False
    assert not old.enabled and old.get("a") is None
    assert new.get("n") == b"vn" and new.stats().errors == 0
    new.close()
    old.close()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 48 MiB tmpfs (needs root and permission to mount)."""
    mnt = tmp_path / "small-fs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "--lazy", str(mnt)], check=True)


def test_small_filesystem_with_the_default_cap_evicts_instead_of_filling_the_disk(small_fs: Path) -> None:
    store = DiskStore(small_fs / "kv", capacity_bytes=DEFAULT_DISK_BYTES)  # 10 GiB cap on a 48 MiB disk
    value = os.urandom(1 << 20)
    for i in range(150):  # 150 MiB written
        assert store.put(f"k{i}", value), f"put {i} refused; {shutil.disk_usage(small_fs).free} bytes free"
        assert shutil.disk_usage(small_fs).free >= store.reserve_bytes
        if i == 60:  # someone else takes most of the free space left: the tier makes room again
            held = store.stats().bytes
            (small_fs / "other-file").write_bytes(b"x" * (shutil.disk_usage(small_fs).free - (1 << 20)))
    s = store.stats()
    assert store.enabled and s.errors == 0 and s.evictions > 100
    assert s.bytes is not None and held is not None and s.bytes < held  # it shrank to leave the reserve free
    assert s.capacity_bytes is not None and s.capacity_bytes < 48 << 20  # the effective capacity, not 10 GiB
    assert store.get("k149") == value and store.get("k0") is None
    store.close()


def test_filesystem_full_of_other_files_refuses_without_disabling(small_fs: Path) -> None:
    store = DiskStore(small_fs / "kv", capacity_bytes=DEFAULT_DISK_BYTES)
    assert store.put("mine", os.urandom(1 << 20))
    free = shutil.disk_usage(small_fs).free
    (small_fs / "other-file").write_bytes(b"x" * (free - (1 << 20)))  # leaves 1 MiB, under the reserve
    assert store.put("big", os.urandom(4 << 20)) is False
    s = store.stats()
    assert store.enabled and s.errors == 0 and s.rejected == 1
    assert store.get("mine") is None  # evicted while trying to make room
    (small_fs / "other-file").unlink()
    assert store.put("big", b"b" * (4 << 20)) and store.get("big") == b"b" * (4 << 20)
    store.close()
