"""Load a snapshot held in the job's memory, wherever it is and whatever world size took it.

:func:`load_whole` loads one old rank's shard onto the rank of the same number (same world
size), read from any node that holds it (ftrun.store.shards). :func:`reshard` loads a
step taken by N ranks onto this job's M ranks: the old ranks' manifests describe every
tensor's global shape and this shard's offsets (DCP's own chunk of a DTensor), from which
:func:`memory_layout` builds the step's ``torch.distributed.checkpoint`` metadata, and
``dcp.load`` with the stock ``DefaultLoadPlanner`` reads each rank's part of every model and
optimizer tensor through :class:`MemoryReader`, a storage reader whose storage is the old
ranks' shards in store memory: it reads only the byte ranges the planner asks for, each
through verified chunks. What has no global form (RNG states, ``extra``, ``state=``
objects, hyper-parameters) is rank ``rank % N``'s, as with a persisted step
(ftrun.rank.fallback).

A plain tensor (not a DTensor) of the model or optimizer that several old ranks hold at the
same offsets is taken to be one replicated tensor (as DDP keeps it) and read from the first
of them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ftrun.errors import IntegrityError
from ftrun.rank.fallback import RESHARDED_ROOTS, overlay, resharded_keys
from ftrun.rank.shards import ShardReader
from ftrun.snapshot.manifest import TensorEntry, entries, tensor_view, unflatten
from ftrun.snapshot.persist import StepLayout, drop_rank_local

log = logging.getLogger("ftrun.restore")

LiveState = Callable[[], dict[str, Any]]


def _tensor(reader: ShardReader, entry: TensorEntry) -> Any:
    """One tensor of an old rank's shard, as a fresh tensor (verified chunks)."""
    blob = bytearray(reader.read(entry.offset, entry.nbytes))
    return tensor_view(memoryview(blob), dataclasses.replace(entry, offset=0))


def load_whole(reader: ShardReader) -> Any:
    """The state tree of one old rank's shard, every chunk verified, in memory of its own."""
    doc, _, _ = reader.meta()
    data = memoryview(reader.whole())
    return unflatten(doc, lambda _i, entry: tensor_view(data, entry))


def _resharded(entry: TensorEntry) -> bool:
    return any(entry.key.startswith(f"/{root}/") for root in RESHARDED_ROOTS)


def memory_layout(docs: dict[int, dict[str, Any]]) -> tuple[
        StepLayout, dict[Any, tuple[int, TensorEntry]]]:
    """The step's DCP metadata, from the old ranks' manifests, and where each stored chunk
    lives: ``MetadataIndex -> (old rank, its manifest entry)``.

    A chunk several ranks hold (a replicated tensor) is taken once, from the lowest rank. A
    tensor whose ranks disagree on its global shape or dtype, or whose chunks do not cover
    it, is rank-local (left out of the metadata; resharding refuses a state that needs it).
    """
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from ftrun.snapshot.manifest import _dtypes

    tensors: dict[str, Any] = {}
    storage: dict[Any, tuple[int, TensorEntry]] = {}
    seen: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    local: set[str] = set()
    for old in sorted(docs):
        for e in entries(docs[old]):
            if not _resharded(e):
                continue
            fqn, dtype = e.fqn, _dtypes().get(e.dtype)
            if dtype is None:
                raise IntegrityError(f"{e.key}: unknown dtype {e.dtype}")
            have = tensors.setdefault(fqn, TensorStorageMetadata(
                TensorProperties(dtype=dtype), torch.Size(e.gshape), []))
            if tuple(have.size) != e.gshape or have.properties.dtype != dtype:
                local.add(fqn)
                continue
            at = (fqn, e.goffsets)
            if at in seen:
                if seen[at] != e.shape:
                    local.add(fqn)
                continue
            seen[at] = e.shape
            have.chunks.append(ChunkStorageMetadata(offsets=torch.Size(e.goffsets),
                                                    sizes=torch.Size(e.shape)))
            storage[MetadataIndex(fqn, torch.Size(e.goffsets))] = (old, e)
    storage = drop_rank_local(tensors, storage, local)
    return StepLayout(Metadata(state_dict_metadata=tensors), sorted(local)), storage


def _reader_class() -> type:
    from torch.distributed.checkpoint.storage import StorageReader

    class MemoryReader(StorageReader):
        """A DCP storage reader over old ranks' shards in the job's stores."""

        def __init__(self, layout: StepLayout, storage: dict[Any, tuple[int, TensorEntry]],
                     readers: dict[int, ShardReader]) -> None:
            super().__init__()
            self.layout, self.storage, self.readers = layout, storage, readers
            self.bytes_read = 0

        def reset(self, checkpoint_id: Any = None) -> None:
            pass

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return self.layout.metadata

        def set_up_storage_reader(self, metadata: Any, is_coordinator: bool,
                                  *args: Any, **kwargs: Any) -> None:
            pass

        def prepare_local_plan(self, plan: Any) -> Any:
            return plan

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            return plans

        def read_data(self, plan: Any, planner: Any) -> Any:
            from torch.distributed.checkpoint.planner import LoadItemType
            from torch.futures import Future

            for req in plan.items:
                if req.type == LoadItemType.BYTE_IO:
                    raise IntegrityError(f"{req.storage_index.fqn}: a non-tensor item; only "
                                         "tensors are resharded")
                old, entry = self.storage[req.storage_index]
                tensor = _tensor(self.readers[old], entry)
                self.bytes_read += entry.nbytes
                for dim, (start, length) in enumerate(
                        zip(req.storage_offsets, req.lengths, strict=True)):
                    tensor = tensor.narrow(dim, start, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise IntegrityError(f"{req.storage_index.fqn}: a read of "
                                         f"{list(tensor.size())} into {list(target.size())}")
                target.copy_(tensor)
                planner.commit_tensor(req, target)
            fut: Future[None] = Future()
            fut.set_result(None)
            return fut

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

    return MemoryReader


def reshard(readers: dict[int, ShardReader], *, rank: int, world_size: int,
            live_state: LiveState) -> tuple[Any, int]:
    """This rank's state from a step of ``len(readers)`` old ranks: (tree, bytes read).

    Model and optimizer tensors are the live ones (``live_state()``), filled by ``dcp.load``;
    the rest of the tree is old rank ``rank % N``'s. Raises IntegrityError (or
    FtrunError) when the step cannot be loaded onto this job.
    """
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    saved_world = len(readers)
    docs = {old: r.meta()[0] for old, r in readers.items()}
    base = readers[rank % saved_world]
    tree = unflatten(docs[rank % saved_world], lambda _i, e: torch.empty(0) if _resharded(e)
                     else _tensor(base, e))
    layout, storage = memory_layout(docs)
    live = live_state()
    flat = resharded_keys(tree, live, layout, saved_world)
    reader = _reader_class()(layout, storage, readers)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # Each rank plans and reads its own part: nothing here waits on the other ranks.
        dcp.load(flat, storage_reader=reader, planner=DefaultLoadPlanner(), no_dist=True)
    for name in RESHARDED_ROOTS:
        if name in tree:
            tree[name] = overlay(tree[name], live[name])
    return tree, reader.bytes_read
