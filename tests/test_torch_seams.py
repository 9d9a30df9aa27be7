"""The private torch internals ftrun uses (ftrun/_torch.py) exist, with the signatures used.

A torch upgrade that moves one of them fails here, naming it, instead of inside a user's job.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.distributed as dist
from conftest import free_port
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ftrun import _torch


def params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_ddp_private_methods_and_signatures() -> None:
    ddp = DistributedDataParallel
    assert params(ddp._ddp_init_helper)[:5] == [
        "self", "parameters", "expect_sparse_gradient", "param_to_name_mapping", "static_graph"]
    assert params(ddp._build_params_for_reducer) == ["self"]
    assert params(ddp._build_debug_param_to_name_mapping) == ["self", "parameters"]
    assert params(ddp._get_ddp_logging_data) == ["self"]
    for name in ("_compute_bucket_assignment_by_size", "_register_comm_hook"):
        assert callable(getattr(dist, name)), name
    for name in ("_rebuild_buckets", "_remove_autograd_hooks", "_set_static_graph",
                 "_set_mixed_precision_param_dtype"):
        assert callable(getattr(dist.Reducer, name)), name
    for name in ("set_runtime_stats_and_log", "_set_static_graph"):
        assert callable(getattr(dist.Logger, name)), name


@pytest.fixture
def group() -> object:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def model() -> nn.Module:
    torch.manual_seed(0)
    # ~3 MiB of parameters: DDP's rebuilt layout has a 1 MiB first bucket, so several buckets.
    return nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 512))


def step(ddp: DistributedDataParallel) -> None:
    ddp(torch.randn(4, 512)).sum().backward()


def test_layout_is_read_after_the_first_backward_and_imposed_on_a_new_reducer(group: object) -> None:
    first = DistributedDataParallel(model())
    assert _torch.ddp_layout(first) is None  # no backward yet: nothing to rebuild from
    step(first)
    layout = _torch.ddp_layout(first)
    assert layout is not None and len(layout) > 1
    assert sorted(i for b in layout for i in b) == list(range(6))
    # The layout DDP itself settles on: rebuilding again changes nothing.
    step(first)
    assert _torch.ddp_layout(first) == layout
    sizes = first._get_ddp_logging_data()["rebuilt_bucket_sizes"]

    second = DistributedDataParallel(model())
    assert second._get_ddp_logging_data()["bucket_sizes"] != sizes  # one initial bucket
    assert _torch.ddp_use_layout(second, layout)
    assert second._get_ddp_logging_data()["bucket_sizes"] == sizes
    step(second)  # gradients still flow through the new reducer
    assert all(p.grad is not None for p in second.parameters())
    step(second)
    assert _torch.ddp_layout(second) == layout


def test_a_layout_that_does_not_fit_is_refused(group: object) -> None:
    ddp = DistributedDataParallel(model())
    reducer = ddp.reducer
    assert not _torch.ddp_use_layout(ddp, [[0, 1, 2]])
    assert ddp.reducer is reducer


def test_agent_shutdown_passes_only_the_arguments_torch_takes() -> None:
    calls: list[tuple] = []

    class Old:  # torch 2.11: _shutdown(self, death_sig)
        def _shutdown(self, death_sig):  # noqa: ANN001, ANN202
            calls.append(("old", death_sig))

    class New:
        def _shutdown(self, death_sig, timeout=30):  # noqa: ANN001, ANN202
            calls.append(("new", death_sig, timeout))

    class A(Old):
        pass

    class B(New):
        pass

    _torch.agent_shutdown(A, A(), 15, 5)
    _torch.agent_shutdown(B, B(), 15, 5)
    assert calls == [("old", 15), ("new", 15, 5)]
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    assert params(LocalElasticAgent._shutdown)[:2] == ["self", "death_sig"]


def test_will_rebuild_follows_ddp_arguments(group: object) -> None:
    plain = DistributedDataParallel(model())
    assert _torch.ddp_will_rebuild(plain)
    step(plain)
    _torch.ddp_layout(plain)
    assert not _torch.ddp_will_rebuild(plain)
    assert not _torch.ddp_will_rebuild(DistributedDataParallel(model(), find_unused_parameters=True))


def test_get_fqns_signature() -> None:
    from torch.distributed.checkpoint.state_dict import _get_fqns

    assert params(_get_fqns)[:2] == ["model", "name"]


def test_optimizer_state_loads_like_torchs_own_path(group: object) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    def trained() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        ddp = DistributedDataParallel(model())
        opt = torch.optim.AdamW([{"params": list(ddp.parameters())[:2], "lr": 1e-3},
                                 {"params": list(ddp.parameters())[2:], "lr": 5e-4}])
        return ddp, opt

    ddp, opt = trained()
    for _ in range(2):
        step(ddp)
        opt.step()
        opt.zero_grad()
    saved = get_optimizer_state_dict(ddp, opt)

    fast_model, fast_opt = trained()
    assert _torch.load_optimizer_state(fast_model, fast_opt, saved)
    slow_model, slow_opt = trained()
    set_optimizer_state_dict(slow_model, slow_opt, saved)
    a, b = fast_opt.state_dict(), slow_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i, entry in a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b["state"][i][key]), (i, key)

    other = torch.optim.AdamW(fast_model.parameters())  # one group, not two: torch's way
    assert not _torch.load_optimizer_state(fast_model, other, saved)


def test_elastic_agent_methods_ftrun_overrides() -> None:
    """FtrunAgent (ftrun/launcher/agent.py) overrides these and calls torch's own."""
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    assert launcher_api.LocalElasticAgent is LocalElasticAgent  # launch.py swaps it in there
    for name in ("_rendezvous", "_start_workers", "_monitor_workers", "_restart_workers"):
        assert params(getattr(LocalElasticAgent, name)) == ["self", "worker_group"], name
    assert params(LocalElasticAgent._set_local_rank_env) == [
        "self", "worker_env", "local_rank", "spec"]
