"""Turn a training state into tensors plus a JSON manifest, and back. No pickle.

A state is a tree of dicts, lists, tuples, tensors, numpy arrays and JSON scalars. Every
tensor (and numpy array) becomes an entry in ``tensors`` with its dtype, shape, and place in
the data region; the tree keeps a reference to it. Anything else is refused with the path of
the offending value, so a snapshot can always be read back without running code.
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
    key: str  # path in the tree, e.g. "model/blocks.0.attn.qkv.weight"
    dtype: str
    shape: tuple[int, ...]
    offset: int  # within the data region
    nbytes: int
    numpy: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape),
                "offset": self.offset, "nbytes": self.nbytes, "numpy": self.numpy}


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
        entry = TensorEntry(path, _dtype_name(local), tuple(local.shape), offset,
                            local.numel() * local.element_size(), is_numpy)
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


def _local(t: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds: a DTensor's local shard, detached, contiguous view if possible."""
    to_local = getattr(t, "to_local", None)
    if callable(to_local) and type(t).__name__ == "DTensor":
        t = to_local()
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
    return [TensorEntry(e["key"], e["dtype"], tuple(e["shape"]), e["offset"], e["nbytes"],
                        e.get("numpy", False)) for e in doc["tensors"]]


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

    return dec(doc["tree"])
