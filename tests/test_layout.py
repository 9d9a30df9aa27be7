"""The global layout a snapshot manifest records for each tensor (what DCP records)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from ftrun.errors import IntegrityError
from ftrun.snapshot.manifest import entries, flatten, manifest_blob, parse_manifest


def _doc(state: dict) -> dict:
    return parse_manifest(manifest_blob(flatten(state), step=1, rank=0, world_size=1, meta={}))


def test_a_plain_tensor_is_its_own_global_tensor() -> None:
    doc = _doc({"model": {"fc.weight": torch.ones(4, 3)}, "step": 1})
    [raw] = doc["tensors"]
    assert raw["global_shape"] == [4, 3] and raw["offsets"] == [0, 0]
    assert "placements" not in raw
    [entry] = entries(doc)
    assert entry.fqn == "model/fc.weight" and entry.gshape == (4, 3)
    assert entry.goffsets == (0, 0) and not entry.sharded and entry.placements == ()


def test_manifests_without_layout_read_as_plain_tensors() -> None:
    doc = _doc({"model": {"w": torch.ones(2)}})
    for raw in doc["tensors"]:  # as an older ftrun wrote it
        del raw["global_shape"], raw["offsets"]
    [entry] = entries(doc)
    assert entry.gshape == (2,) and entry.goffsets == (0,)


def test_a_shard_that_does_not_fit_its_global_shape_is_refused() -> None:
    doc = _doc({"model": {"w": torch.ones(4, 3)}})
    doc["tensors"][0].update(global_shape=[6, 3], offsets=[4, 0])
    with pytest.raises(IntegrityError, match=r"does not fit its global shape \[6, 3\]"):
        entries(doc)
    layout = {"global_shape": [8, 3], "offsets": [4, 0], "placements": ["S(0)"], "mesh": [2]}
    doc["tensors"][0].update(layout)
    [entry] = entries(json.loads(json.dumps(doc)))
    assert entry.sharded and entry.goffsets == (4, 0) and entry.to_json()["mesh"] == [2]


def test_a_dtensor_records_dcps_chunk_and_its_placements() -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
        replicated = distribute_tensor(torch.ones(3), mesh, [Replicate()])
        flat = flatten({"model": {"w": sharded, "b": replicated}})
        w, b = entries(parse_manifest(manifest_blob(flat, step=1, rank=0, world_size=1,
                                                    meta={})))
        [chunk] = sharded.__create_chunk_list__()
        assert w.gshape == tuple(sharded.shape) == (6, 2)
        assert w.goffsets == tuple(chunk.offsets) and w.shape == tuple(chunk.sizes)
        assert w.placements == (str(Shard(0)),) and w.mesh == (1,)
        assert b.placements == (str(Replicate()),) and b.gshape == (3,)
        assert torch.equal(flat.sources[0], sharded.to_local())  # the bytes are the shard's
    finally:
        dist.destroy_process_group()
