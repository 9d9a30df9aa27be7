"""On-disk checkpoints, in ``torch.distributed.checkpoint`` (DCP) format, of verified snapshots.

The node's snapshot store (not the ranks) writes them from a VERIFIED buffer. One DCP
checkpoint per step, written in parts by the stores of every node::

    <persist dir>/step_<S:09d>/                  one DCP checkpoint of the whole step
        .metadata                                global tensors, every rank's shards as chunks
        rank_<r:05d>/                            rank r's part, written by its node's store
            __0_0.distcp, .metadata              its shards (DCP save), and their metadata
            ftrun-manifest.json                  the snapshot's manifest (tree, layout, meta)
            ftrun-hashes.json                    xxh3-64 (hex) of every shard, by manifest key
        .tmp-rank_<r:05d>-<pid>/                 a rank being written (never valid)

Each rank directory holds what ``dcp.save({"model": ..., "optim": ..., "ftrun": {...}})``
of the rank's state writes: DCP's own keys for nested dicts (``"model.fc.weight"``,
``"optim.state.fc.weight.exp_avg"``, ``"optim.param_groups.0.lr"``; every other root of the
state, such as ``rng``, ``extra``, ``stateful`` and ``step``, under ``"ftrun."``), each shard
saved at the global offsets its manifest records (a DTensor's chunk, or offsets 0 for a plain
tensor), values that are not tensors as DCP bytes (``torch.save``). So ``dcp.load`` of
``{"model": model_sd, "optim": optim_sd}`` (torch's ``get_state_dict`` helpers), or of
``{"model": model.state_dict()}`` alone, reads a step as it reads any DCP checkpoint
(:func:`dcp_keys`). ftrun itself reads the tensors by those keys and everything else from
``ftrun-manifest.json``, from which :func:`load_rank` rebuilds a rank's exact state tree
without unpickling anything. The version of ``ftrun-hashes.json`` names the layout of the
keys: 2, or 1 for steps of ftrun's first layout (``"model/fc.weight"``, no bytes), which are
read as they are.

A rank directory only appears, by an atomic rename, once every file in it is written and
fsynced. The writer that completes the set of ranks merges their metadata into the step's
``.metadata`` (:func:`finalize_step`; a rename, so it is whole or absent). A step is complete
when every rank ``0..W-1`` has a directory, their manifests agree on W and on the epoch (the
incarnation of the workers that took the snapshot: a step written again after a restart must
not mix ranks of two timelines), and the step's ``.metadata`` is there. Scanning and pruning
never import torch; writing, merging and loading import it (and DCP) on first use.

``torch.distributed.checkpoint.load(sd, checkpoint_id=STEP_DIR)`` reads the global tensors
(and the values all ranks share) onto any world size, or whole with ``no_dist=True``, and
PyTorch's converter turns a step into one file of nested dicts::

    python -m torch.distributed.checkpoint.format_utils dcp_to_torch STEP_DIR out.pt

(in torch 2.13 the mode is the positional ``dcp_to_torch``). :func:`to_torch_save` writes one
``torch.save`` file holding a rank's whole state tree.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from ftrun.errors import ConfigError, FtrunError, IntegrityError
from ftrun.snapshot.manifest import (
    TensorEntry,
    decoder,
    entries,
    parse_manifest,
    tensor_view,
    unflatten,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MANIFEST_FILE = "ftrun-manifest.json"
HASHES_FILE = "ftrun-hashes.json"
DCP_METADATA = ".metadata"
HASHES_VERSION = 2  # it names the rank directory's layout too: LAYOUT_FLAT (1), LAYOUT_NESTED
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".del-"
STALE_TMP_S = 3600.0
VERIFY_BATCH_BYTES = 256 * 2**20

STEP_RE = re.compile(r"^step_(\d+)$")
RANK_RE = re.compile(r"^rank_(\d+)$")

PathLike = str | os.PathLike[str]


# -- names ------------------------------------------------------------------------------------


def step_dir(persist_dir: PathLike, step: int) -> Path:
    return Path(persist_dir) / f"step_{step:09d}"


def rank_dir(persist_dir: PathLike, step: int, rank: int) -> Path:
    return step_dir(persist_dir, step) / f"rank_{rank:05d}"


# -- where each value sits in the DCP checkpoint -----------------------------------------------

LAYOUT_FLAT = 1  # ftrun's first layout: "model/fc.weight", the manifest key without its "/"
LAYOUT_NESTED = 2  # DCP's own flattening of {"model": ..., "optim": ..., "ftrun": {the rest}}
# State roots stored under their own name: the names of torch's get_state_dict helpers and
# of PyTorch's DCP recipe, so {"model": ...} loads. (torchtitan's checkpointer keeps model keys
# at the top level and names the optimizer "optimizer"; docs/snapshots.md says how to load a
# step there.)
STANDARD_ROOTS = ("model", "optim")
FTRUN_ROOT = "ftrun"  # every other root (rng, extra, stateful, step, ...) is stored under it

TreePath = tuple[Any, ...]


def dcp_key(path: TreePath, layout: int) -> str:
    """The checkpoint key of the value at ``path`` (dict keys and list indices from the root
    of the snapshot's state) in a rank directory of ``layout``."""
    if layout == LAYOUT_FLAT:
        return "/".join(map(str, path))
    return ".".join(map(str, _stored_path(path)))


def _stored_path(path: TreePath) -> TreePath:
    return path if path and str(path[0]) in STANDARD_ROOTS else (FTRUN_ROOT, *path)


@dataclass(frozen=True)
class DcpKeys:
    """Where one rank's state sits in its DCP checkpoint (see the module docstring)."""

    layout: int  # LAYOUT_FLAT or LAYOUT_NESTED
    tensors: list[str]  # the key of every tensor entry, index-aligned with the manifest's
    objects: dict[str, Any]  # key -> manifest tree node, for each value stored as DCP bytes
    paths: dict[str, TreePath]  # key -> its path in the nested state (DCP's planner_data)


def dcp_keys(doc: dict[str, Any], layout: int = LAYOUT_NESTED) -> DcpKeys:
    """The checkpoint keys of a manifest's state; refuses two values under one key.

    ``LAYOUT_NESTED`` follows ``torch.distributed.checkpoint``'s own flattening
    (``_nested_dict.flatten_state_dict``): dicts are walked (keys as ``str``), a list is
    walked when it holds a tensor or a dict, anything else (numbers, strings, tuples, lists
    of plain values, None) is one value, stored as DCP bytes (``torch.save``). So the keys
    are those ``dcp.save({"model": ..., "optim": ..., "ftrun": {...}})`` writes. A tensor
    inside such a value (a tuple holding tensors) is stored there and also under a key of
    its own, as is every numpy array, for ftrun's reads, which go tensor by tensor.
    """
    table = entries(doc)
    if layout == LAYOUT_FLAT:
        keys = [e.key.lstrip("/") for e in table]
        _refuse_collisions(list(zip(keys, [e.key for e in table], strict=True)))
        return DcpKeys(layout, keys, {}, {})
    if layout != LAYOUT_NESTED:
        raise IntegrityError(f"unknown on-disk layout {layout}; this ftrun reads "
                             f"{LAYOUT_FLAT} and {LAYOUT_NESTED}: use a newer ftrun")
    decode = decoder(doc, None)
    tensor_paths: dict[int, TreePath] = {}
    objects: dict[TreePath, Any] = {}
    nested: list[TreePath] = []  # of the tensors stored as keys of their own in DCP too

    def tensors_in(node: Any, path: TreePath) -> None:
        if not isinstance(node, dict):
            return
        if "T" in node:
            tensor_paths[node["T"]] = path
        for k, v in node.get("D", ()):
            tensors_in(v, (*path, str(decode(k))))
        for i, v in enumerate(node.get("L", node.get("U", ()))):
            tensors_in(v, (*path, i))

    def walk(node: Any, path: TreePath) -> None:
        if isinstance(node, dict) and "T" in node:
            tensor_paths[node["T"]] = path
            nested.append(path)
        elif isinstance(node, dict) and "D" in node:
            for k, v in node["D"]:
                walk(v, (*path, str(decode(k))))
        elif isinstance(node, dict) and "L" in node and not _terminal(node):
            for i, v in enumerate(node["L"]):
                walk(v, (*path, i))
        else:
            objects[path] = node
            tensors_in(node, path)

    root = doc["tree"]
    if not (isinstance(root, dict) and "D" in root):
        raise ConfigError("the state root must be a dict (model/optim/rng/extra/step), not a "
                          "bare tensor or value")
    walk(root, ())
    named = [(dcp_key(tensor_paths[i], layout), e.key) for i, e in enumerate(table)]
    named += [(dcp_key(path, layout), "/" + "/".join(map(str, path))) for path in objects]
    _refuse_collisions(named)
    # A tensor inside a stored value (a tuple) stays out of planner_data: DCP's converter
    # would try to set it inside that tuple.
    return DcpKeys(layout, [key for key, _ in named[:len(table)]],
                   {dcp_key(path, layout): node for path, node in objects.items()},
                   {dcp_key(path, layout): _stored_path(path) for path in [*nested, *objects]})


def _terminal(node: Any) -> bool:
    """Whether DCP stores this list as one value: it holds no tensor, no dict, and no list
    that is walked (the rule of torch.distributed.checkpoint._traverse)."""
    for child in node["L"]:
        if isinstance(child, dict) and ("T" in child or "D" in child):
            return False
        if isinstance(child, dict) and "L" in child and not _terminal(child):
            return False
    return True


def _refuse_collisions(named: list[tuple[str, str]]) -> None:
    seen: dict[str, str] = {}
    for key, what in named:
        if key in seen:
            raise ConfigError(
                f"{seen[key]!r} and {what!r} map to the same checkpoint key {key!r}; rename "
                "one of the state's dict keys (keys differing only in type, e.g. 1 and '1', "
                "or in '.' against nesting, e.g. 'a.b' and a/b, collide)"
            )
        seen[key] = what


def xxh3_hex(value: int) -> str:
    return f"{value:016x}"


def tensor_xxh3(t: torch.Tensor) -> int:
    """xxh3-64 of a tensor's raw bytes (what the snapshot store records for it)."""
    import torch

    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return xxhash.xxh3_64_intdigest(b"")
    return xxhash.xxh3_64_intdigest(memoryview(flat.view(torch.uint8).numpy()))


def _dtype(name: str, key: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise IntegrityError(f"tensor {key}: unknown dtype {name!r} in the manifest")
    return dtype


# -- torch.distributed.checkpoint, imported on first use (it is slow to import) ---------------


@contextmanager
def _quiet_dcp() -> Iterator[Any]:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # Single-process use is the point here; DCP warns about it on every call.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield dcp


def import_dcp() -> None:
    """Import torch.distributed.checkpoint now (seconds), ahead of the first write."""
    with _quiet_dcp():
        pass


def _read_metadata(path: Path) -> Any:
    """The DCP ``Metadata`` of a checkpoint directory (IntegrityError when unreadable)."""
    try:
        with _quiet_dcp() as dcp:
            return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # DCP raises whatever unpickling a bad file raises
        raise IntegrityError(f"{path / DCP_METADATA} is unreadable ({e}); the checkpoint "
                             "is corrupt: use another step") from e


def _write_items(table: list[TensorEntry], keys: DcpKeys,
                 state: dict[str, Any]) -> list[Any]:
    """DCP's ``WriteItem`` of every shard, from the layout the manifest recorded: exactly what
    DCP's default planner makes of the DTensor (a SHARD chunk) or plain tensor it was; and
    one of every value stored as bytes."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    items = [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
             for key in keys.objects]
    for entry, key in zip(table, keys.tensors, strict=True):
        offsets = torch.Size(entry.goffsets)
        items.append(WriteItem(
            index=MetadataIndex(key, offsets),
            type=WriteItemType.SHARD if entry.placements else WriteItemType.TENSOR,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(entry.shape)),
                properties=TensorProperties.create_from_tensor(state[key]),
                size=torch.Size(entry.gshape))))
    return items


@functools.cache
def _planners() -> tuple[type, type]:
    """DCP planners for one rank's shards: a save planner that writes the shards at their
    recorded global offsets, and a load planner that reads a shard back into a plain tensor
    of its local shape (DCP's resharding reads, narrowed to the shard)."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        create_default_global_save_plan,
    )
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, SavePlanner
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class ShardSavePlanner(SavePlanner):
        def __init__(self, items: list[Any], paths: dict[str, Any]) -> None:
            self.items = items
            self.paths = paths
            self.state: dict[str, Any] = {}

        def set_up_planner(self, state_dict: Any, storage_meta: Any = None,
                           is_coordinator: bool = False) -> None:
            self.state = state_dict

        def create_local_plan(self) -> Any:
            return SavePlan(self.items)

        def create_global_plan(self, all_plans: list[Any]) -> Any:
            # Not DefaultSavePlanner's: it checks that the chunks cover each global tensor,
            # which one rank's shards never do. The paths let DCP's converter nest the keys.
            plans, metadata = create_default_global_save_plan(all_plans)
            return plans, dataclasses.replace(metadata, planner_data=self.paths or None)

        def finish_plan(self, new_plan: Any) -> Any:
            return new_plan

        def resolve_data(self, write_item: Any) -> Any:
            return self.state[write_item.index.fqn]

    class ShardLoadPlanner(DefaultLoadPlanner):
        def __init__(self, chunks: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self.chunks = chunks

        def create_local_plan(self) -> Any:
            items = []
            for fqn in self.state_dict:
                md = self.metadata.state_dict_metadata.get(fqn)
                offsets, sizes = self.chunks[fqn]
                if not isinstance(md, TensorStorageMetadata):
                    raise IntegrityError(f"tensor {fqn} is not in the checkpoint's metadata")
                if len(md.size) != len(sizes):
                    raise IntegrityError(f"tensor {fqn}: the checkpoint holds {len(md.size)} "
                                         f"dimensions, the manifest {len(sizes)}")
                local = ChunkStorageMetadata(offsets=torch.Size(offsets),
                                             sizes=torch.Size(sizes))
                items += create_read_items_for_chunk_list(fqn, md, [local])
            return LoadPlan(items)

        def resolve_tensor(self, read_item: Any) -> Any:
            tensor = self.state_dict[read_item.dest_index.fqn]
            for dim, (start, length) in enumerate(
                    zip(read_item.dest_offsets, read_item.lengths, strict=True)):
                tensor = tensor.narrow(dim, start, length)
            return tensor

    return ShardSavePlanner, ShardLoadPlanner


def _dcp_save(state: dict[str, Any], path: Path, table: list[TensorEntry],
              keys: DcpKeys) -> None:
    save_planner, _ = _planners()
    planner = save_planner(_write_items(table, keys, state), keys.paths)
    with _quiet_dcp() as dcp:
        writer = dcp.FileSystemWriter(str(path), sync_files=True, thread_count=1)
        dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)


def _dcp_load(state: dict[str, torch.Tensor], path: Path, table: list[TensorEntry],
              keys: list[str]) -> None:
    """Fill ``state`` (plain tensors of the shards' local shapes) with the shards recorded in
    ``table`` from the DCP checkpoint at ``path`` (a rank directory or a whole step)."""
    _, load_planner = _planners()
    chunks = {key: (e.goffsets, e.shape) for key, e in zip(keys, table, strict=True)}
    with _quiet_dcp() as dcp:
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)),
                 planner=load_planner(chunks), no_dist=True)


def storage_files(path: PathLike) -> dict[str, str]:
    """DCP key -> the file (relative to the rank directory) holding that tensor's bytes."""
    return {key: span[0] for key, span in storage_spans(path).items()}


def storage_spans(path: PathLike) -> dict[str, tuple[str, int, int]]:
    """DCP key -> (file relative to the rank directory, offset, length) of its stored bytes."""
    metadata = _read_metadata(Path(path))
    return {index.fqn: (info.relative_path, info.offset, info.length)
            for index, info in metadata.storage_data.items()}


# -- small durable-file helpers ---------------------------------------------------------------


def _write_durable(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath), directory=True)


# -- writing ----------------------------------------------------------------------------------


def _check_doc(doc: dict[str, Any]) -> tuple[int, int, int]:
    try:
        step, rank, world = int(doc["step"]), int(doc["rank"]), int(doc["world_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise IntegrityError(f"manifest lacks a valid step/rank/world_size ({e!r})") from e
    if step < 0 or world < 1 or not 0 <= rank < world:
        raise IntegrityError(
            f"manifest says step {step}, rank {rank} of world size {world}: not a valid snapshot"
        )
    return step, rank, world


def write_rank(persist_dir: PathLike, doc: dict[str, Any], data: memoryview | bytes,
               hashes: list[int]) -> Path:
    """Persist one rank's verified snapshot as ``step_<S>/rank_<r>``; returns that directory.

    ``doc`` is the parsed manifest, ``data`` the snapshot's data region and ``hashes`` the
    xxh3-64 the store recorded per tensor. Every tensor is re-hashed first: corrupt bytes are
    never written (IntegrityError). The caller keeps ``data`` unchanged until this returns;
    no view into it is left behind. Idempotent: an existing ``rank_<r>`` directory is left as
    it is, unless it holds another epoch's snapshot of the step (or is unreadable): then it
    is replaced. Writing goes to ``.tmp-rank_<r>-<pid>`` in the step directory, fsynced, then
    renamed: a crash leaves only a temp directory, which is never taken for a checkpoint.
    """
    step, rank, world = _check_doc(doc)
    table = entries(doc)
    keys = dcp_keys(doc)
    if len(hashes) != len(table):
        raise IntegrityError(
            f"step {step} rank {rank}: {len(hashes)} hashes for {len(table)} tensors; "
            "the snapshot's hash table does not belong to its manifest"
        )
    final = rank_dir(persist_dir, step, rank)
    replace = False
    if final.is_dir():
        existing = read_rank_dir(final, step=step, rank=rank)
        if existing.problem is None and existing.epoch == epoch_of(doc):
            log.debug("%s exists already; leaving it", final)
            _finalize_after_write(persist_dir, step, world)
            return final
        replace = True
        log.info("replacing %s (%s)", final, existing.problem or
                 f"written by epoch {existing.epoch}, this snapshot is of epoch {epoch_of(doc)}")
    view = memoryview(data).cast("B")
    try:
        _check_bytes(view, table, hashes, f"step {step} rank {rank}")
        _write_dir(final, doc, view, table, keys, hashes, replace=replace)
    finally:
        try:
            view.release()
        except BufferError:  # pragma: no cover - only if a tensor over it escaped
            pass
    _finalize_after_write(persist_dir, step, world)
    return final


def _finalize_after_write(persist_dir: PathLike, step: int, world_size: int) -> None:
    """Whichever writer puts the step's last part in place merges its one DCP checkpoint.
    A failure leaves the step partial (restore skips it); the rank's part stays written."""
    try:
        finalize_step(persist_dir, step, world_size)
    except FtrunError as e:
        log.error("step %d: could not merge its %s (%s); the step stays partial", step,
                  DCP_METADATA, e)


def _stored_objects(doc: dict[str, Any], keys: DcpKeys, view: memoryview) -> dict[str, Any]:
    """Each value DCP stores as bytes, ``torch.save``-d as DCP's own planner does (a tensor
    in it copied out: a view would save the whole data region)."""
    import io

    import torch

    decode = decoder(doc, lambda _i, entry: tensor_view(view, entry).clone())
    out = {}
    for key, node in keys.objects.items():
        buf = io.BytesIO()
        torch.save(decode(node), buf)
        out[key] = buf
    return out


def _check_bytes(view: memoryview, table: list[TensorEntry], hashes: list[int],
                 what: str) -> None:
    for entry, expected in zip(table, hashes, strict=True):
        end = entry.offset + entry.nbytes
        if entry.offset < 0 or end > len(view):
            raise IntegrityError(
                f"{what}: tensor {entry.key} spans bytes [{entry.offset}, {end}) of a "
                f"{len(view)}-byte data region; the manifest does not fit its snapshot"
            )
        with view[entry.offset:end] as part:
            actual = xxhash.xxh3_64_intdigest(part)
        if actual != expected:
            raise IntegrityError(
                f"{what}: tensor {entry.key} hashes to {xxh3_hex(actual)} but the snapshot "
                f"recorded {xxh3_hex(expected)}; refusing to persist corrupt bytes"
            )


def epoch_of(doc: dict[str, Any]) -> str | None:
    """The epoch a manifest's snapshot was taken in (None for snapshots without one)."""
    meta = doc.get("meta")
    epoch = meta.get("epoch") if isinstance(meta, dict) else None
    return str(epoch) if epoch else None


def _write_dir(final: Path, doc: dict[str, Any], view: memoryview, table: list[TensorEntry],
               keys: DcpKeys, hashes: list[int], *, replace: bool = False) -> Path:
    step, rank = int(doc["step"]), int(doc["rank"])
    parent = final.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {parent}: {e.strerror}; make the persist directory "
                          "writable or point the persist option elsewhere") from e
    tmp = parent / f"{TMP_PREFIX}rank_{rank:05d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    state: dict[str, Any] = {}
    try:
        tmp.mkdir()
        _write_durable(tmp / MANIFEST_FILE, json.dumps(doc, separators=(",", ":")).encode())
        hashes_doc = {"v": HASHES_VERSION, "algorithm": "xxh3_64", "step": step, "rank": rank,
                      "tensors": {e.key: xxh3_hex(h) for e, h in zip(table, hashes, strict=True)}}
        _write_durable(tmp / HASHES_FILE, json.dumps(hashes_doc, indent=1).encode())
        with warnings.catch_warnings():
            # A read-only buffer (bytes) is only read here.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            state = {key: tensor_view(view, e) for key, e in zip(keys.tensors, table, strict=True)}
            state.update(_stored_objects(doc, keys, view))
        _dcp_save(state, tmp, table, keys)
        state.clear()
        _fsync_tree(tmp)
        if replace:
            # Only this node ever writes this rank: nobody races the swap. The step's global
            # metadata described the old set: it goes first, and is merged again once the
            # new set is complete.
            _unlink(parent / DCP_METADATA)
            _remove_dir(final, parent.parent)
        try:
            os.rename(tmp, final)
        except OSError as e:
            if not final.is_dir():
                raise
            log.debug("%s appeared while writing (%s); keeping it", final, e.strerror)
            shutil.rmtree(tmp, ignore_errors=True)
            return final
        _fsync_path(parent, directory=True)
        _fsync_path(parent.parent, directory=True)
    except BaseException as e:
        state.clear()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, FtrunError) or not isinstance(e, Exception):
            raise
        if isinstance(e, OSError):
            raise ConfigError(
                f"cannot write step {step} rank {rank} to {parent}: {e}; check that the persist "
                "directory is writable and has space"
            ) from e
        raise FtrunError(f"writing step {step} rank {rank} to {parent} failed: {e!r}") from e
    log.info("persisted step %d rank %d to %s", step, rank, final)
    return final


# -- one checkpoint per step ------------------------------------------------------------------


@dataclass
class StepLayout:
    """The DCP ``Metadata`` of a whole step, merged from its rank directories."""

    metadata: Any  # torch.distributed.checkpoint.metadata.Metadata
    rank_local: list[str]  # DCP keys left out: their shards do not form one global tensor,
    # or the ranks hold different values under them
    keys: int = LAYOUT_FLAT  # the layout of its keys (an in-memory reshard's are flat)


def merge_layout(step: StepDir) -> StepLayout:
    """Merge every rank's DCP metadata into the step's: each tensor's global shape and all
    its chunks, each chunk read from its rank directory (``rank_<r>/__0_0.distcp``).

    A chunk that several ranks hold (a replicated or plain tensor, offsets equal) is taken
    once, from the lowest rank, when every copy hashes the same. A tensor whose copies differ
    (per-rank state such as RNG states), whose ranks disagree on its shape or dtype, or
    whose chunks do not cover it, is rank-local: it stays in the rank directories only. So
    is a value stored as bytes (a hyper-parameter, the step number, ``extra``) that differs
    between the ranks; one they agree on is read from the lowest rank's directory.
    """
    import dataclasses

    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    tensors: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    paths: dict[str, Any] = {}
    first: dict[tuple[str, tuple[int, ...]], tuple[int, Any, tuple[int, ...]]] = {}
    local: set[str] = set()
    layouts: set[int] = set()
    for rd in step.ranks:
        md = _read_metadata(rd.path)
        doc = read_manifest(rd.path)
        table = entries(doc)
        layout, recorded = _read_hashes_file(rd.path)
        layouts.add(layout)
        keys = dcp_keys(doc, layout)
        hash_of: dict[str, Any] = {
            key: recorded.get(e.key) for key, e in zip(keys.tensors, table, strict=True)}
        hash_of.update({key: _fingerprint(node, table, recorded)
                        for key, node in keys.objects.items()})
        paths.update(md.planner_data or {})
        for fqn, tmd in md.state_dict_metadata.items():
            if isinstance(tmd, BytesStorageMetadata) and fqn in keys.objects:
                objects[fqn] = tmd
                seen = first.setdefault((fqn, ()), (rd.rank, hash_of[fqn], ()))
                if seen[1] != hash_of[fqn]:
                    local.add(fqn)
                continue
            if not isinstance(tmd, TensorStorageMetadata):
                local.add(fqn)
                continue
            have = tensors.setdefault(fqn, TensorStorageMetadata(tmd.properties, tmd.size, []))
            if have.size != tmd.size or have.properties.dtype != tmd.properties.dtype:
                local.add(fqn)
                continue
            for chunk in tmd.chunks:
                at = (fqn, tuple(chunk.offsets))
                seen = first.get(at)
                if seen is None:
                    first[at] = (rd.rank, hash_of.get(fqn), tuple(chunk.sizes))
                    have.chunks.append(chunk)
                elif seen[1:] != (hash_of.get(fqn), tuple(chunk.sizes)):
                    local.add(fqn)
        for index, info in md.storage_data.items():
            owner = first.get((index.fqn, tuple(index.offset or ())))
            if owner is not None and owner[0] == rd.rank:
                storage[MetadataIndex(index.fqn, index.offset)] = dataclasses.replace(
                    info, relative_path=f"{rd.path.name}/{info.relative_path}")
    if len(layouts) > 1:
        raise IntegrityError(f"{step.path}: its ranks were written in different on-disk "
                             f"layouts ({sorted(layouts)}) by different ftrun versions")
    storage = drop_rank_local(tensors, storage, local)
    objects = {k: v for k, v in objects.items() if k not in local}
    described = {**tensors, **objects}
    planner_data = {k: tuple(v) for k, v in paths.items() if k in described}
    return StepLayout(Metadata(state_dict_metadata=described, storage_data=storage,
                               planner_data=planner_data or None),
                      sorted(local), layouts.pop() if layouts else LAYOUT_FLAT)


def _fingerprint(node: Any, table: list[TensorEntry], recorded: dict[str, int]) -> str:
    """A value stored as bytes, as comparable text: its manifest node, with each tensor in it
    replaced by its recorded hash (``torch.save`` output is not the same for equal values)."""

    def plain(obj: Any) -> Any:
        if isinstance(obj, dict) and "T" in obj:
            return {"T": recorded.get(table[obj["T"]].key)}
        if isinstance(obj, dict):
            return {k: plain(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [plain(v) for v in obj]
        return obj

    return json.dumps(plain(node), sort_keys=True)


def drop_rank_local(tensors: dict[str, Any], storage: dict[Any, Any],
                    local: set[str]) -> dict[Any, Any]:
    """Add to ``local`` every tensor whose chunks do not cover it, take every rank-local
    tensor out of ``tensors`` (in place); returns ``storage`` without their chunks."""
    import math

    for fqn, tmd in tensors.items():
        if sum(math.prod(c.sizes) for c in tmd.chunks) != math.prod(tmd.size):
            local.add(fqn)
    for fqn in local:
        tensors.pop(fqn, None)
    return {i: v for i, v in storage.items() if i.fqn not in local}


def finalize_step(persist_dir: PathLike, step: int, world_size: int | None = None) -> bool:
    """Write ``step_<S>/.metadata`` once every rank's directory is in place; True when the
    step then has one.

    Any store may call it after writing its ranks (the one that completes the set does the
    work; the others find the set incomplete, or the file there). Calls that race write the
    same description, each into its own temp directory, then rename it into place, so the
    file is always whole. Steps written by an older ftrun (no layout in their manifests) are
    left as they are: they restore on their own world size only. With ``world_size``, a step
    whose rank directories are not all there yet is passed over by their names alone.
    """
    path = step_dir(persist_dir, step)
    if world_size is not None:
        try:
            names = set(os.listdir(path))
        except FileNotFoundError:
            return False
        if DCP_METADATA in names:
            return True
        if any(f"rank_{r:05d}" not in names for r in range(world_size)):
            return False
    try:
        found = read_step_dir(path)
    except FileNotFoundError:
        return False
    if found.merged:
        return True
    if found.why_parts_incomplete is not None or not all(r.layout for r in found.ranks):
        return False
    layout = merge_layout(found)
    tmp = path / f"{TMP_PREFIX}metadata-{os.getpid()}-{time.monotonic_ns()}"
    try:
        _write_metadata(layout.metadata, tmp, path)
        os.replace(tmp / DCP_METADATA, path / DCP_METADATA)
        _fsync_path(path, directory=True)
    except OSError as e:
        raise ConfigError(f"cannot write {path / DCP_METADATA}: {e}; check that the persist "
                          "directory is writable and has space") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("step %d: merged %s of %d ranks%s", step, path / DCP_METADATA, len(found.ranks),
             f" ({len(layout.rank_local)} rank-local tensor(s) left out)"
             if layout.rank_local else "")
    return True


def _write_metadata(metadata: Any, tmp: Path, final: Path) -> None:
    """DCP's own ``FileSystemWriter.finish`` writes the file (its format and version)."""
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.storage import WriteResult

    with _quiet_dcp() as dcp:
        class StepWriter(dcp.FileSystemWriter):  # type: ignore[misc,name-defined]
            def storage_meta(self) -> StorageMeta:
                return StorageMeta(checkpoint_id=str(final), save_id=self.save_id)

        results = [WriteResult(index=i, size_in_bytes=info.length, storage_data=info)
                   for i, info in metadata.storage_data.items()]
        tmp.mkdir()
        StepWriter(str(tmp), sync_files=True).finish(metadata, [results])


def step_layout(step: StepDir) -> StepLayout:
    """The step's ``.metadata``, checked against its rank directories (IntegrityError when it
    is missing or describes other files: a stale or foreign file is never trusted)."""
    file = step.path / DCP_METADATA
    if not file.is_file():
        raise IntegrityError(f"{file} is missing: the step is not one complete checkpoint")
    on_disk = _read_metadata(step.path)
    merged = merge_layout(step)

    def described(md: Any) -> tuple[Any, Any]:
        chunks = {fqn: (tuple(t.size), t.properties.dtype,
                        sorted((tuple(c.offsets), tuple(c.sizes)) for c in t.chunks))
                  if hasattr(t, "chunks") else "bytes"
                  for fqn, t in md.state_dict_metadata.items()}
        spans = {(i.fqn, tuple(i.offset or ())): (v.relative_path, v.offset, v.length)
                 for i, v in md.storage_data.items()}
        return chunks, spans

    if described(on_disk) != described(merged.metadata):
        raise IntegrityError(f"{file} does not describe the rank directories beside it (it "
                             "was written for another set of them); the step is corrupt: use "
                             "another step")
    return StepLayout(on_disk, merged.rank_local, merged.keys)


# -- scanning ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankDir:
    """One final ``rank_<r>`` directory, as found on disk."""

    rank: int
    path: Path
    world_size: int | None  # from its manifest; None when unreadable
    problem: str | None  # why it cannot be used, naming the file (None: usable)
    epoch: str | None = None  # the epoch that took the snapshot (manifest meta)
    layout: bool = True  # its manifest records the global layout (False: an older ftrun's)


@dataclass(frozen=True)
class StepDir:
    """One ``step_<S>`` directory: its final rank directories and unfinished writes."""

    step: int
    path: Path
    ranks: tuple[RankDir, ...]
    pending: tuple[Path, ...]  # ``.tmp-*`` directories (a write in progress or abandoned)
    merged: bool = False  # the step's global ``.metadata`` is in place

    @property
    def world_size(self) -> int | None:
        """The world size all usable ranks agree on (None when none or disagreeing)."""
        sizes = {r.world_size for r in self.ranks if r.problem is None}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def complete(self) -> bool:
        return self.why_incomplete is None

    @property
    def why_incomplete(self) -> str | None:
        """Why this step cannot be restored as it is on disk (None: it is complete)."""
        why = self.why_parts_incomplete
        if why is None and not self.merged and all(r.layout for r in self.ranks):
            return (f"partial: every rank is written but the step's {DCP_METADATA} is not "
                    "(the store that writes the last part merges it)")
        return why

    @property
    def why_parts_incomplete(self) -> str | None:
        """Why the rank directories do not form one whole step (None: they do)."""
        if self.problems:
            return f"corrupt: {self.problems[0]}"
        pending = (f"; {len(self.pending)} write(s) in progress or abandoned "
                   f"({', '.join(p.name for p in self.pending)})" if self.pending else "")
        if not self.ranks:
            return f"partial: no rank finished writing{pending}"
        sizes = sorted({r.world_size for r in self.ranks if r.world_size is not None})
        if len(sizes) != 1:
            return f"partial: its ranks disagree on the world size ({sizes})"
        world = sizes[0]
        epochs = sorted({str(r.epoch) for r in self.ranks})
        if len(epochs) != 1:
            return (f"partial: its ranks were written by different incarnations of the job "
                    f"(epochs {', '.join(epochs)}): never mixed")
        missing = sorted(set(range(world)) - {r.rank for r in self.ranks})
        if missing:
            return (f"partial: rank(s) {_ranges(missing)} of {world} missing (a node did not "
                    f"write its part){pending}")
        return None

    @property
    def problems(self) -> list[str]:
        return [r.problem for r in self.ranks if r.problem is not None]


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out: list[str] = []
    for v in values:
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


def read_manifest(path: PathLike) -> dict[str, Any]:
    """The manifest doc of a rank directory (IntegrityError naming the file when unusable)."""
    file = Path(path) / MANIFEST_FILE
    try:
        blob = file.read_bytes()
    except FileNotFoundError:
        raise IntegrityError(f"{file} is missing; the rank directory is not a complete ftrun "
                             "checkpoint: use another step") from None
    except OSError as e:
        raise IntegrityError(f"{file} is unreadable: {e.strerror}") from e
    try:
        doc = parse_manifest(blob)
        entries(doc)
        _check_doc(doc)
        if "tree" not in doc:
            raise KeyError("tree")
    except IntegrityError as e:
        raise IntegrityError(f"{file}: {e}") from e
    except (KeyError, TypeError, ValueError) as e:
        raise IntegrityError(f"{file} is not a valid ftrun manifest ({e!r})") from e
    return doc


def read_hashes(path: PathLike) -> dict[str, int]:
    """Manifest key -> recorded xxh3-64, from a rank directory's ``ftrun-hashes.json``."""
    return _read_hashes_file(path)[1]


def read_layout(path: PathLike) -> int:
    """The layout a rank directory was written in (``LAYOUT_FLAT``: ftrun's first;
    ``LAYOUT_NESTED``), as its ``ftrun-hashes.json`` records it (its version)."""
    return _read_hashes_file(path)[0]


def rank_keys(path: PathLike, doc: dict[str, Any]) -> DcpKeys:
    """The checkpoint keys of a rank directory's state (``doc``: its manifest)."""
    return dcp_keys(doc, read_layout(path))


def _read_hashes_file(path: PathLike) -> tuple[int, dict[str, int]]:
    file = Path(path) / HASHES_FILE
    try:
        doc = json.loads(file.read_bytes())
        version = doc.get("v")
        if version not in (LAYOUT_FLAT, LAYOUT_NESTED):
            raise ValueError(f"version {version!r}; this ftrun reads {LAYOUT_FLAT} to "
                             f"{HASHES_VERSION}: a newer ftrun wrote it?")
        return version, {str(k): int(v, 16) for k, v in doc["tensors"].items()}
    except FileNotFoundError:
        raise IntegrityError(f"{file} is missing; the tensors cannot be checked") from None
    except OSError as e:
        raise IntegrityError(f"{file} is unreadable: {e.strerror}") from e
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise IntegrityError(f"{file} is not a valid ftrun hash file ({e})") from e


def read_rank_dir(path: PathLike, *, step: int | None = None, rank: int | None = None) -> RankDir:
    """Describe a final rank directory; ``step``/``rank`` (from its names) are checked too."""
    path = Path(path)
    if rank is None:
        m = RANK_RE.match(path.name)
        rank = int(m.group(1)) if m else -1
    if not (path / DCP_METADATA).is_file():
        return RankDir(rank, path, None, f"{path / DCP_METADATA} is missing (not a complete "
                       "DCP checkpoint)")
    try:
        doc = read_manifest(path)
    except IntegrityError as e:
        return RankDir(rank, path, None, str(e))
    world = int(doc["world_size"])
    if rank >= 0 and int(doc["rank"]) != rank:
        return RankDir(rank, path, world,
                       f"{path / MANIFEST_FILE} is for rank {doc['rank']}, not {rank}",
                       epoch_of(doc))
    if step is not None and int(doc["step"]) != step:
        return RankDir(rank, path, world,
                       f"{path / MANIFEST_FILE} is for step {doc['step']}, not {step}",
                       epoch_of(doc))
    layout = all("global_shape" in e for e in doc["tensors"])
    return RankDir(int(doc["rank"]), path, world, None, epoch_of(doc), layout)


def read_step_dir(path: PathLike) -> StepDir:
    path = Path(path)
    m = STEP_RE.match(path.name)
    if not m:
        raise ConfigError(f"{path} is not a step directory (named step_<number>)")
    step = int(m.group(1))
    ranks: list[RankDir] = []
    pending: list[Path] = []
    for child in sorted(path.iterdir()):
        if child.name.startswith(TMP_PREFIX):
            pending.append(child)
            continue
        rm = RANK_RE.match(child.name)
        if rm and child.is_dir():
            ranks.append(read_rank_dir(child, step=step, rank=int(rm.group(1))))
    return StepDir(step, path, tuple(sorted(ranks, key=lambda r: r.rank)), tuple(pending),
                   (path / DCP_METADATA).is_file())


def list_steps(persist_dir: PathLike) -> list[StepDir]:
    """Every step directory under ``persist_dir``, newest first (complete or not)."""
    root = Path(persist_dir)
    try:
        children = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = []
    for child in children:
        if STEP_RE.match(child.name) and child.is_dir():
            try:
                steps.append(read_step_dir(child))
            except FileNotFoundError:  # pruned meanwhile (by another node's store)
                continue
    return sorted(steps, key=lambda s: s.step, reverse=True)


def complete_steps(persist_dir: PathLike) -> list[tuple[int, int]]:
    """(step, world_size) of every complete step, newest first."""
    out = []
    for s in list_steps(persist_dir):
        world = s.world_size
        if s.complete and world is not None:
            out.append((s.step, world))
    return out


def latest_complete(persist_dir: PathLike) -> tuple[int, int] | None:
    """(step, world_size) of the newest complete step, or None."""
    steps = complete_steps(persist_dir)
    return steps[0] if steps else None


def prune(persist_dir: PathLike, keep: int) -> list[Path]:
    """Keep the newest ``keep`` complete steps; remove the other complete ones and every step
    that is not complete but older than the newest complete one.

    Only complete steps count towards ``keep``, so the newest complete step is never removed.
    A step that is not complete and older than the newest complete one can never complete
    (each store writes its targets in order): it goes. Incomplete steps newer than the newest
    complete one stay (a write may be in progress; restore skips them). ``.tmp-*``
    directories untouched for an hour are removed too. Returns what was removed.
    """
    if keep < 1:
        raise ConfigError(
            f"keep={keep}: at least the newest complete step must be kept; pass keep >= 1"
        )
    root = Path(persist_dir)
    removed: list[Path] = []
    steps = list_steps(root)
    complete = [s.step for s in steps if s.complete]
    kept = set(complete[:keep])
    newest = complete[0] if complete else None
    now = time.time()
    for s in steps:
        if newest is not None and s.step not in kept and (s.complete or s.step < newest):
            _remove_dir(s.path, root)
            removed.append(s.path)
            continue
        for tmp in s.pending:
            try:
                stale = now - tmp.stat().st_mtime > STALE_TMP_S
            except FileNotFoundError:
                continue
            if stale:
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
    for leftover in root.glob(f"{TRASH_PREFIX}*") if root.is_dir() else ():
        shutil.rmtree(leftover, ignore_errors=True)
    if removed:
        log.info("pruned %d director%s under %s", len(removed),
                 "y" if len(removed) == 1 else "ies", root)
    return removed


def _remove_dir(path: Path, root: Path) -> None:
    """Rename out of sight first, so a half-removed step is never seen under its name."""
    trash = root / f"{TRASH_PREFIX}{path.name}-{os.getpid()}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


# -- reading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """A tensor whose bytes on disk do not match its recorded hash (or cannot be read)."""

    key: str
    file: str  # path of the .distcp file holding it ("" when unknown)
    expected: str  # recorded xxh3 hex ("" when none recorded)
    actual: str  # xxh3 hex of what was read ("" when unreadable)
    reason: str

    def __str__(self) -> str:
        return f"{self.file or '?'}: tensor {self.key}: {self.reason}"


def _empty_like_entry(entry: TensorEntry) -> torch.Tensor:
    import torch

    return torch.empty(entry.shape, dtype=_dtype(entry.dtype, entry.key))


def _load_flat(path: Path, table: list[TensorEntry], keys: list[str]) -> dict[str, torch.Tensor]:
    state = {key: _empty_like_entry(e) for key, e in zip(keys, table, strict=True)}
    try:
        _dcp_load(state, path, table, keys)
    except Exception as e:  # DCP wraps everything into CheckpointException
        raise IntegrityError(f"{path}: torch.distributed.checkpoint.load failed ({e}); the "
                             "checkpoint is corrupt or incomplete: use another step") from e
    return state


def read_tensors(path: PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a rank directory by its DCP key, as stored (not verified)."""
    path = Path(path)
    doc = read_manifest(path)
    return _load_flat(path, entries(doc), rank_keys(path, doc).tensors)


def load_dir(path: PathLike, *, verify: bool = True) -> Any:
    """The state tree of one rank directory (see :func:`load_rank`)."""
    path = Path(path)
    if not (path / DCP_METADATA).is_file():
        raise IntegrityError(f"{path / DCP_METADATA} is missing; not a complete checkpoint")
    doc = read_manifest(path)
    table = entries(doc)
    layout, recorded = _read_hashes_file(path)
    keys = dcp_keys(doc, layout).tensors
    state = _load_flat(path, table, keys)
    if verify:
        files: dict[str, str] | None = None
        for entry, key in zip(table, keys, strict=True):
            expected = recorded.get(entry.key)
            actual = tensor_xxh3(state[key])
            if expected == actual:
                continue
            if files is None:
                files = storage_files(path)
            where = path / files.get(key, "?")
            if expected is None:
                raise IntegrityError(f"{path / HASHES_FILE} records no hash for tensor "
                                     f"{entry.key}; the checkpoint cannot be verified")
            raise IntegrityError(
                f"{where}: tensor {entry.key} (checkpoint key {key}) hashes to "
                f"{xxh3_hex(actual)} but {HASHES_FILE} records {xxh3_hex(expected)}; the file "
                "is corrupt: restore from another step"
            )
    return unflatten(doc, lambda i, _entry: state[keys[i]])


def load_rank(persist_dir: PathLike, step: int, rank: int, *, verify: bool = True) -> Any:
    """Read ``step_<S>/rank_<r>`` back into its state tree (as ``manifest.unflatten`` gives).

    Tensors are freshly allocated with the manifest's dtypes and shapes and filled through
    ``torch.distributed.checkpoint.load``; numpy entries come back as numpy arrays. With
    ``verify`` each tensor is checked against ``ftrun-hashes.json`` (IntegrityError naming
    the file and the tensor). The root is the dict the snapshot was taken of.
    """
    path = rank_dir(persist_dir, step, rank)
    if not path.is_dir():
        raise IntegrityError(f"no checkpoint of step {step} rank {rank}: {path} does not exist")
    return load_dir(path, verify=verify)


def verify_dir(path: PathLike, *, on_tensor: Callable[[str, int], None] | None = None,
               batch_bytes: int = VERIFY_BATCH_BYTES) -> list[Mismatch]:
    """Re-hash every tensor of a rank directory against ``ftrun-hashes.json``.

    Reads at most about ``batch_bytes`` at a time; calls ``on_tensor(key, nbytes)`` after
    each tensor. Returns every mismatch (an unreadable tensor counts as one).
    """
    path = Path(path)
    doc = read_manifest(path)
    table = entries(doc)
    layout, recorded = _read_hashes_file(path)
    keys = dcp_keys(doc, layout).tensors
    files = storage_files(path)
    out: list[Mismatch] = []

    def file_of(key: str) -> str:
        return str(path / files[key]) if key in files else ""

    def check(batch: list[int]) -> None:
        try:
            state = _load_flat(path, [table[i] for i in batch], [keys[i] for i in batch])
        except IntegrityError as e:
            if len(batch) > 1:  # find out which tensor it is
                for i in batch:
                    check([i])
                return
            i = batch[0]
            exp = recorded.get(table[i].key)
            out.append(Mismatch(table[i].key, file_of(keys[i]),
                                xxh3_hex(exp) if exp is not None else "", "", f"unreadable: {e}"))
            if on_tensor:
                on_tensor(table[i].key, table[i].nbytes)
            return
        for i in batch:
            entry, key = table[i], keys[i]
            actual = tensor_xxh3(state.pop(key))
            exp = recorded.get(entry.key)
            if exp is None:
                out.append(Mismatch(entry.key, file_of(key), "", xxh3_hex(actual),
                                    f"no hash recorded in {HASHES_FILE}"))
            elif exp != actual:
                out.append(Mismatch(entry.key, file_of(key), xxh3_hex(exp), xxh3_hex(actual),
                                    f"hashes to {xxh3_hex(actual)}, recorded {xxh3_hex(exp)}"))
            if on_tensor:
                on_tensor(entry.key, entry.nbytes)

    batch: list[int] = []
    size = 0
    for i, entry in enumerate(table):
        batch.append(i)
        size += entry.nbytes
        if size >= batch_bytes:
            check(batch)
            batch, size = [], 0
    if batch:
        check(batch)
    return out


# -- leaving ftrun ----------------------------------------------------------------------------


def to_torch_save(path: PathLike, out_file: PathLike) -> Path:
    """Write a rank directory's state tree (model/optim/rng/extra/step) to one ``torch.save``.

    ``path`` is a rank directory, or a step directory (then rank 0's is written). Tensors are
    verified first. The file loads with ``torch.load(out_file, weights_only=True)`` unless the
    state holds numpy arrays or numpy scalars (then ``weights_only=False``).
    """
    path = Path(path)
    if (path / MANIFEST_FILE).is_file() or RANK_RE.match(path.name):
        source = path
    elif STEP_RE.match(path.name) and path.is_dir():
        source = path / f"rank_{0:05d}"
        if not source.is_dir():
            raise IntegrityError(f"{path} has no rank_00000 directory (the step is incomplete); "
                                 "pass another step or a rank directory")
    else:
        raise ConfigError(f"{path} is neither a step_<S> nor a rank_<r> checkpoint directory; "
                          "pass one of those (see `ftrun inspect`)")
    import torch

    tree = load_dir(source, verify=True)
    out = Path(out_file)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        torch.save(tree, tmp)
        _fsync_path(tmp)
        os.replace(tmp, out)
    except OSError as e:
        raise ConfigError(f"cannot write {out}: {e}; choose a writable output file") from e
    finally:
        if tmp.exists():
            tmp.unlink()
    return out
