"""Chunk hashes: taken as the rank copies, checked on every later hop."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from snapshot_helpers import stage_segment
from test_store_epoch import run_id  # noqa: F401 (fixture)

from ftrun.errors import IntegrityError
from ftrun.snapshot import verify
from ftrun.snapshot.api import PersistConfig
from ftrun.snapshot.manifest import flatten, tensor_view
from ftrun.store.api import StoreConfig
from ftrun.store.store import SnapshotStore


def test_chunks_are_hashed_as_their_tensors_land_in_any_order() -> None:
    state = {"a": torch.arange(100.0), "b": torch.ones(7, dtype=torch.int8),
             "c": torch.randn(33), "d": torch.zeros(0)}
    flat = flatten(state)
    buf = bytearray(flat.data_len)
    data = memoryview(buf)
    with ThreadPoolExecutor(2) as pool:
        hasher = verify.ChunkHasher(data, [(e.offset, e.nbytes) for e in flat.tensors], 64, pool)
        for i in reversed(range(len(flat.tensors))):
            e = flat.tensors[i]
            if e.nbytes:
                tensor_view(data, e).copy_(flat.sources[i].reshape(e.shape))
            hasher.copied(i)
        got = hasher.finish()
    assert len(got) == -(-flat.data_len // 64) > 3
    assert got == verify.hash_chunks(data, 64)


def test_a_chunk_is_never_hashed_before_all_its_tensors_are_copied() -> None:
    flat = flatten({"a": torch.ones(40), "b": torch.ones(40)})
    data = memoryview(bytearray(flat.data_len))
    with ThreadPoolExecutor(1) as pool:
        hasher = verify.ChunkHasher(data, [(e.offset, e.nbytes) for e in flat.tensors], 4096, pool)
        hasher.copied(0)
        with pytest.raises(IntegrityError, match="before all its tensors"):
            hasher.finish()


def test_a_mismatch_names_the_chunk_and_its_tensors(run_id: str) -> None:  # noqa: F811
    seg = stage_segment(run_id, 0, 0, {"w": torch.ones(10), "v": torch.ones(3)}, step=2)
    assert verify.check(seg) == (True, "")
    h = seg.header()
    seg.mm[h.data_off + 5] ^= 1
    ok, reason = verify.check(seg)
    assert not ok and "chunk 0" in reason and "tensor /" in reason, reason
    seg.close()


def test_the_persist_copy_refuses_bytes_changed_after_the_rank_hashed_them(
        run_id: str, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    root = Path(tempfile.mkdtemp(prefix="ftrun-test-verify-"))
    try:
        seg = stage_segment(run_id, 0, 0, {"w": torch.arange(64.0)}, step=4)
        store = SnapshotStore(StoreConfig(run_id=run_id, url="ipc:///nonexistent",
                                          coordinator=None, node_id="h/1",
                                          owner_pid=os.getpid(), persist=PersistConfig(dir=str(root)),
                                          threads=2), b"s" * 32)
        h = seg.header()
        seg.mm[h.data_off + 17] ^= 0x40  # after the rank hashed it
        names, problem = store.persister.locate_step(4)
        shards, problem = store.persister.copy_shards(4, names)
        assert problem == "" and len(shards) == 1
        with caplog.at_level(logging.ERROR, logger="ftrun.store"):
            store.persister.write(4, shards)
        assert "hash mismatch in 1 chunk" in caplog.text and "tensor /w" in caplog.text
        assert not list(root.rglob("*.distcp"))
        seg.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
