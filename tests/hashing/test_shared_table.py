"""The prefix index's table in a file several processes map (hashing/_block_table.c).

Real processes: a child Python interpreter writes or takes the table's lock, the test's
process reads. The table's semantics, shared or not, are tests/hashing/test_prefix_index.py's
model test (run over two mappings of one file there).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from hashing._block_table import BlockTable

from hashing.blocks import chain, root_key
from hashing.prefix_index import PrefixIndex
from hashing.rendezvous import name_hash
from hashing.tiered_index import TieredIndex
from tests.tmpfs import small_disk

ROOT = root_key("m", None)
#: where the header keeps its lock: after the 8-byte magic number
LOCK_OFFSET = 8


def _child(code: str) -> str:
    """Run `code` in a new interpreter (bounded); its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _keys(doc: int) -> list[int]:
    return chain(ROOT, list(range(doc * 4096, doc * 4096 + 4096)), 16)


def test_what_another_process_writes_is_read_here(tmp_path: Path) -> None:
    """A child learns 200 prompts of 256 blocks on two backends (the arrays move many
    times as they grow) into a table this process mapped before: every prompt is found
    here, with its holders, and the child's ids for the backends are this process's."""
    path = tmp_path / "index-gpu"
    here = PrefixIndex()
    here.share(str(path))
    _child(f"""
        from hashing.blocks import chain, root_key
        from hashing.prefix_index import PrefixIndex
        index = PrefixIndex()
        index.share({str(path)!r})
        root = root_key("m", None)
        for doc in range(200):
            keys = chain(root, list(range(doc * 4096, doc * 4096 + 4096)), 16)
            index.learn("b" if doc % 2 else "a", keys, 1e12)
    """)
    for doc in range(200):
        own = "b" if doc % 2 else "a"
        assert here.longest_prefix(_keys(doc), own) == 256, doc
        assert here.holders(_keys(doc), 4) == [(own, 256)], doc
    assert here.size("a") == here.size("b") == (0, 100 * 256)
    assert here.holder_keys() == 200 * 256


def test_a_process_that_dies_holding_the_lock_leaves_a_table_that_works(tmp_path: Path) -> None:
    """A child takes the table's lock and exits without letting go (as a worker killed
    mid-update would): the next call here finds the table possibly half-changed, starts
    it empty and counts a reset; the table then works, with the ids it gave before."""
    path = tmp_path / "index-gpu"
    index = PrefixIndex()
    index.share(str(path))
    index.learn("a", _keys(0), 1e12)
    _child(f"""
        import ctypes, mmap, os
        fd = os.open({str(path)!r}, os.O_RDWR)
        mapped = mmap.mmap(fd, mmap.PAGESIZE)
        lock = ctypes.addressof(ctypes.c_char.from_buffer(mapped)) + {LOCK_OFFSET}
        libc = ctypes.CDLL(None)
        assert libc.pthread_mutex_lock(ctypes.c_void_p(lock)) == 0
        os._exit(0)
    """)
    table = BlockTable(str(path))
    assert len(table) == 0
    assert table.resets == 1
    assert index.longest_prefix(_keys(0), "a") == 0
    index.learn("a", _keys(1), 1e12)
    assert table.longest(_keys(1), table.member(name_hash("a"))) == 256
    assert table.resets == 1


def test_a_table_is_set_up_once(tmp_path: Path) -> None:
    table = BlockTable(str(tmp_path / "t"))
    with pytest.raises(TypeError, match="set up once"):
        table.__init__(str(tmp_path / "t"))
    with pytest.raises(OSError, match="No such file"):
        BlockTable(str(tmp_path / "missing" / "t"))


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs (mounting needs root: the CI container's user)."""
    with small_disk(tmp_path / "small", "16m") as where:
        yield where


def test_a_full_file_system_cuts_writes_short_and_loses_nothing_held(small_tmpfs: Path) -> None:
    """A table on a 16 MiB tmpfs fed 2,000 prompts of 256 blocks (~30 MiB of entries):
    no write raises (a write to a full tmpfs would kill the process); the ones that
    needed a growth the file system had no room for keep what fit, and are counted;
    the prompts held before are still found; once a backend leaves, its room is reused."""
    index = PrefixIndex()
    index.share(str(small_tmpfs / "index-gpu"))
    for doc in range(2000):
        index.learn(f"b{doc % 4}", _keys(doc), 1e12)
    assert index.cut_short > 0
    assert index.longest_prefix(_keys(0), "b0") == 256
    held = index.holder_keys()
    assert 0 < held < 2000 * 256
    index.forget("b1")
    index.learn("b2", _keys(5000), 1e12)
    assert index.longest_prefix(_keys(5000), "b2") == 256


def test_holders_another_process_placed_are_named_once_the_fleet_is_known(
    tmp_path: Path,
) -> None:
    """A process names a holder by the id the table gave it: one whose keys only another
    process wrote is unnamed here until this process knows the fleet (`join`, at every
    membership change), and then found."""
    path = str(tmp_path / "index-gpu")
    writer, reader = PrefixIndex(), PrefixIndex()
    writer.share(path)
    reader.share(path)
    writer.learn("x", _keys(0), 1e12)
    assert reader.holders(_keys(0), 4) == []
    reader.join(["x", "y"])
    assert reader.holders(_keys(0), 4) == [("x", 256)]


def test_a_decision_holding_the_tables_sees_no_other_process_write(tmp_path: Path) -> None:
    """While one process holds the index (`steady`, around a routing decision) another
    one's write waits: the decision's reads agree with each other. The write lands once
    the hold ends."""
    index = TieredIndex()
    index.share(str(tmp_path))
    code = f"""
        import sys
        from hashing.blocks import chain, root_key
        from hashing.tiered_index import TieredIndex
        index = TieredIndex()
        index.share({str(tmp_path)!r})
        print("writing", flush=True)
        keys = chain(root_key("m", None), list(range(4096)), 16)
        index.gpu.learn("x", keys, 1e12)
    """
    with index.steady():
        child = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout.readline() == "writing\n"
            with pytest.raises(subprocess.TimeoutExpired):  # it waits for the hold
                child.wait(timeout=1)
            assert index.gpu.longest_prefix(_keys(0), "x") == 0
        except BaseException:
            child.kill()
            raise
    assert child.wait(timeout=60) == 0
    assert index.gpu.longest_prefix(_keys(0), "x") == 256


def test_a_file_of_another_layout_is_refused_not_rewritten(tmp_path: Path) -> None:
    """A table file another version of the module set up (its magic number differs) may
    be in use by that version's processes: it is refused with a clear error, untouched."""
    path = tmp_path / "index-gpu"
    BlockTable(str(path))
    with path.open("r+b") as f:
        f.write((0x016B7672746162).to_bytes(8, "little"))
    with pytest.raises(OSError, match="another layout"):
        BlockTable(str(path))
    with path.open("rb") as f:
        assert int.from_bytes(f.read(8), "little") == 0x016B7672746162
