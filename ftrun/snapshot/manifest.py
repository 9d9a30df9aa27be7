"""Turn a training state into tensors plus a JSON manifest, and back. No pickle.

A state is a tree of dicts, lists, tuples, tensors, numpy arrays and JSON scalars. Every
tensor (and numpy array) becomes an entry in ``tensors`` with its dtype, shape, and place in
the data region; the tree keeps a reference to it. Anything else is refused with the path of
the offending value, so a snapshot can always be read back without running code.

Each entry also records the tensor's place in the *global* tensor, as
``torch.distributed.checkpoint`` (DCP) records a chunk: the fully-qualified name (the key
without its leading ``/``), the global shape, and the offsets of this rank's shard in it
(its sizes are ``shape``); for a DTensor also its placements and mesh shape. A plain tensor
is its own global tensor (offsets 0). This is what lets a snapshot taken on N ranks be
assembled into one DCP checkpoint and loaded onto M ranks (see ``ftrun.snapshot.persist``).
"""

from __future__ import annotations

import base64
import functools
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ftrun.errors import ConfigError, IntegrityError
from ftrun.snapshot.segment import align

if TYPE_CHECKING:
    import torch

MANIFEST_VERSION = 1


@functools.cache
def _dtypes() -> dict[str, torch.dtype]:
    # Built on first use: the node's store reads manifests without importing torch.
    import torch

    return {
        str(dt).removeprefix("torch."): dt
        for dt in (
            torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
            torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32,
            torch.uint64, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
            torch.float8_e5m2,
        )
    }


@dataclass(frozen=True)
class TensorEntry:
    key: str  # path in the tree, e.g. "/model/blocks.0.attn.qkv.weight"
    dtype: str
    shape: tuple[int, ...]  # this rank's shard (the chunk's sizes)
    offset: int  # within the data region
    nbytes: int
    numpy: bool = False
    global_shape: tuple[int, ...] | None = None  # None: the shard is the whole tensor
    offsets: tuple[int, ...] | None = None  # of the shard in the global tensor; None: zeros
    placements: tuple[str, ...] = ()  # a DTensor's, e.g. ("Shard(dim=0)",); () otherwise
    mesh: tuple[int, ...] = ()  # a DTensor's device-mesh shape

    @property
    def fqn(self) -> str:
        """The key without its leading ``/`` ("model/fc.weight"): the tensor's name in the
        step metadata of an in-memory reshard (and in ftrun's first on-disk layout; persisted
        steps now use DCP's own nested keys, see ``ftrun.snapshot.persist.dcp_keys``)."""
        return self.key.lstrip("/")

    @property
    def gshape(self) -> tuple[int, ...]:
        """The global tensor's shape (this shard's shape for a plain tensor)."""
        return self.shape if self.global_shape is None else self.global_shape

    @property
    def goffsets(self) -> tuple[int, ...]:
        """Where this shard starts in the global tensor, per dimension."""
        return (0,) * len(self.shape) if self.offsets is None else self.offsets

    @property
    def sharded(self) -> bool:
        """Whether this rank holds only part of the global tensor."""
        return self.gshape != self.shape

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "key": self.key, "dtype": self.dtype, "shape": list(self.shape),
            "offset": self.offset, "nbytes": self.nbytes, "numpy": self.numpy,
            "global_shape": list(self.gshape), "offsets": list(self.goffsets)}
        if self.placements:
            out["placements"] = list(self.placements)
            out["mesh"] = list(self.mesh)
        return out

    @classmethod
    def from_json(cls, e: dict[str, Any]) -> TensorEntry:
        shape = tuple(int(d) for d in e["shape"])
        gshape = tuple(int(d) for d in e.get("global_shape", shape))
        offsets = tuple(int(o) for o in e.get("offsets", (0,) * len(shape)))
        if len(gshape) != len(shape) or len(offsets) != len(shape) or any(
                o < 0 or o + n > g for o, n, g in zip(offsets, shape, gshape, strict=True)):
            raise IntegrityError(
                f"{e['key']}: a shard of shape {list(shape)} at offsets {list(offsets)} does not "
                f"fit its global shape {list(gshape)}; the manifest is corrupt")
        return cls(e["key"], e["dtype"], shape, e["offset"], e["nbytes"], e.get("numpy", False),
                   None if gshape == shape else gshape,
                   None if not any(offsets) else offsets,
                   tuple(e.get("placements", ())), tuple(e.get("mesh", ())))


@dataclass
class Flattened:
    tree: Any
    tensors: list[TensorEntry]
    sources: list[torch.Tensor]  # what to copy, index-aligned with ``tensors``
    data_len: int


def _dtype_name(t: torch.Tensor) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in _dtypes():
        raise ConfigError(f"tensor dtype {t.dtype} cannot be snapshotted")
    return name


def flatten(state: Any) -> Flattened:
    """Describe ``state``: JSON tree with tensor references, and the tensors to copy."""
    tensors: list[TensorEntry] = []
    sources: list[torch.Tensor] = []
    offset = 0

    def add(t: torch.Tensor, path: str, is_numpy: bool) -> dict[str, int]:
        nonlocal offset
        local = _local(t)
        global_shape, offsets, placements, mesh = _layout(t, local)
        entry = TensorEntry(path, _dtype_name(local), tuple(local.shape), offset,
                            local.numel() * local.element_size(), is_numpy, global_shape,
                            offsets, placements, mesh)
        tensors.append(entry)
        sources.append(local)
        offset = align(offset + entry.nbytes)
        return {"T": len(tensors) - 1}

    import torch

    def enc(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return add(obj, path, False)
        if type(obj).__module__ == "numpy" and hasattr(obj, "dtype") and hasattr(obj, "shape"):
            import numpy as np

            if isinstance(obj, np.ndarray):
                return add(torch.from_numpy(np.ascontiguousarray(obj)), path, True)
            return {"npv": obj.item(), "npt": str(obj.dtype)}  # numpy scalar
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return obj if abs(obj) < 2**53 else {"I": str(obj)}
        if isinstance(obj, float):
            return obj if math.isfinite(obj) else {"F": repr(obj)}
        if isinstance(obj, bytes):
            return {"B": base64.b64encode(obj).decode()}
        if isinstance(obj, dict):
            return {"D": [[enc(k, f"{path}/<key>"), enc(v, f"{path}/{k}")] for k, v in obj.items()]}
        if isinstance(obj, list):
            return {"L": [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, tuple):
            return {"U": [enc(v, f"{path}/{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, torch.dtype):
            return {"dt": str(obj).removeprefix("torch.")}
        raise ConfigError(
            f"cannot snapshot {path or 'state'} of type {type(obj).__qualname__}: use tensors, "
            "numpy arrays, numbers, strings, bytes, lists, tuples and dicts"
        )

    tree = enc(state, "")
    return Flattened(tree, tensors, sources, offset)


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" and callable(getattr(t, "to_local", None))


def _layout(t: torch.Tensor, local: torch.Tensor) -> tuple[
        tuple[int, ...] | None, tuple[int, ...] | None, tuple[str, ...], tuple[int, ...]]:
    """(global shape, offsets, placements, mesh shape) of ``t``; Nones for a plain tensor.

    A DTensor's chunk is DCP's own (``__create_chunk_list__``, what its save planner
    writes), so the manifest and a DCP checkpoint of the same state agree.
    """
    if not _is_dtensor(t):
        return None, None, (), ()
    chunks = t.__create_chunk_list__()  # type: ignore[attr-defined]
    if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
        raise ConfigError(
            f"a DTensor of shape {tuple(t.shape)} and placements {t.placements} "  # type: ignore[attr-defined]
            f"has {len(chunks)} chunks on this rank; ftrun snapshots DTensors whose local "
            "shard is one contiguous chunk (Shard/Replicate placements, as FSDP2 and TP use)")
    offsets = tuple(int(o) for o in chunks[0].offsets)
    gshape = tuple(int(d) for d in t.shape)
    return (gshape if gshape != tuple(local.shape) else None,
            offsets if any(offsets) else None,
            tuple(str(p) for p in t.placements),  # type: ignore[attr-defined]
            tuple(int(d) for d in t.device_mesh.shape))  # type: ignore[attr-defined]


def _local(t: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds: a DTensor's local shard, detached, contiguous view if possible."""
    if _is_dtensor(t):
        t = t.to_local()  # type: ignore[attr-defined]
    return t.detach()


def manifest_blob(flat: Flattened, *, step: int, rank: int, world_size: int, meta: dict[str, Any]) -> bytes:
    doc = {
        "v": MANIFEST_VERSION, "step": step, "rank": rank, "world_size": world_size,
        "tensors": [e.to_json() for e in flat.tensors], "tree": flat.tree, "meta": meta,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def parse_manifest(blob: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(blob)
    except ValueError as e:
        raise IntegrityError(f"manifest is not JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("v") != MANIFEST_VERSION:
        raise IntegrityError(f"manifest version {doc.get('v') if isinstance(doc, dict) else '?'} unknown")
    return doc


def entries(doc: dict[str, Any]) -> list[TensorEntry]:
    return [TensorEntry.from_json(e) for e in doc["tensors"]]


def tensor_paths(state: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """(path, tensor) of every tensor in ``state``: the dict keys and list/tuple indices
    leading to it, as ``flatten`` walks them; DTensors kept whole (to load a checkpoint into)."""
    import torch

    if isinstance(state, torch.Tensor):
        return [(path, state)]
    out: list[tuple[tuple[Any, ...], Any]] = []
    if isinstance(state, dict):
        for k, v in state.items():
            out += tensor_paths(v, (*path, k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out += tensor_paths(v, (*path, i))
    return out


def tensor_view(data: memoryview, entry: TensorEntry) -> torch.Tensor:
    """A tensor over the snapshot's bytes (no copy)."""
    import torch

    if entry.dtype not in _dtypes():
        raise IntegrityError(f"{entry.key}: unknown dtype {entry.dtype}")
    dtype = _dtypes()[entry.dtype]
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    flat = torch.frombuffer(data, dtype=torch.uint8, count=entry.nbytes, offset=entry.offset)
    return flat.view(dtype).view(entry.shape)


def unflatten(doc: dict[str, Any], tensor_of: Any) -> Any:
    """Rebuild the tree; ``tensor_of(index, entry)`` supplies each tensor."""
    return decoder(doc, tensor_of)(doc["tree"])


def decoder(doc: dict[str, Any], tensor_of: Any) -> Any:
    """A function that rebuilds any node of the manifest's tree (a subtree of it, or a dict
    key); ``tensor_of(index, entry)`` supplies each tensor."""
    table = entries(doc)

    def dec(obj: Any) -> Any:
        if not isinstance(obj, dict):
            return obj
        if "T" in obj:
            entry = table[obj["T"]]
            t = tensor_of(obj["T"], entry)
            return t.numpy() if entry.numpy else t
        if "D" in obj:
            return {dec(k): dec(v) for k, v in obj["D"]}
        if "L" in obj:
            return [dec(v) for v in obj["L"]]
        if "U" in obj:
            return tuple(dec(v) for v in obj["U"])
        if "I" in obj:
            return int(obj["I"])
        if "F" in obj:
            return float(obj["F"])
        if "B" in obj:
            return base64.b64decode(obj["B"])
        if "dt" in obj:
            return _dtypes()[obj["dt"]]
        if "npv" in obj:
            import numpy as np

            return np.dtype(obj["npt"]).type(obj["npv"])
        raise IntegrityError(f"manifest tree holds an unknown node {sorted(obj)}")

    return dec
