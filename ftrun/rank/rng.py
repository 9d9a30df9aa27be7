"""The RNG states a training step draws from (torch CPU and CUDA, numpy, python ``random``),
taken as tensors of fixed shapes so that a snapshot's manifest can be written before their
values are taken (see ``Snapshotter``), and set back on restore."""

from __future__ import annotations

import math
import random
from typing import Any

import torch


def rng_state() -> dict[str, Any]:
    """Every RNG state a training step may draw from, as tensors of fixed shapes.

    Fixed shapes let a snapshot's manifest be written before the values are taken: the
    values are those of the moment the next forward pass starts (see ``Snapshotter``).
    """
    version, mt, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *mt], dtype=torch.int64),
        "python_gauss": torch.tensor([math.nan if gauss is None else gauss], dtype=torch.float64),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = torch.from_numpy(keys.astype(np.int64))
    state["numpy_meta"] = torch.tensor([pos, has_gauss], dtype=torch.int64)
    state["numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
    return state


def refresh_rng_state(state: dict[str, Any]) -> None:
    """Overwrite the tensors of an earlier ``rng_state()`` with the states of now."""
    now = rng_state()
    for key, old in state.items():
        new = now.get(key)
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
            old.copy_(new)
        elif isinstance(old, list) and isinstance(new, list):
            for a, b in zip(old, new, strict=True):
                a.copy_(b)


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].clone())
    py = state["python"]
    if isinstance(py, torch.Tensor):
        gauss = float(state["python_gauss"][0])
        values = py.tolist()
        random.setstate((values[0], tuple(values[1:]), None if math.isnan(gauss) else gauss))
    else:  # snapshots written before RNG states were tensors
        random.setstate(py)
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.clone() for t in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        np_state = state["numpy"]
        if isinstance(np_state, torch.Tensor):
            pos, has_gauss = (int(v) for v in state["numpy_meta"])
            np_state = ("MT19937", np_state.numpy().astype(np.uint32), pos, has_gauss,
                        float(state["numpy_gauss"][0]))
        np.random.set_state(np_state)
