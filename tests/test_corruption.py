"""Silent-corruption detection, the pure parts: the replicated block's layout and digest
(ftrun.snapshot.replicas), the comparison across replicas and the commit rule
(ftrun.coordinator.corruption, CommitTracker), and the policy's decisions. The whole path, in
a real job with a flipped bit, is
tests/test_user_ddp.py::test_a_flipped_bit_is_named_never_restored_and_the_job_ends_bit_identical."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ftrun.coordinator.commits import CommitTracker
from ftrun.coordinator.corruption import CorruptionPolicy, Report, compare
from ftrun.errors import ConfigError
from ftrun.launcher.args import FtrunOptions
from ftrun.snapshot import verify
from ftrun.snapshot.manifest import flatten, manifest_blob, parse_manifest, tensor_view
from ftrun.snapshot.replicas import Group, block_digests, place, seal

CHUNK = 256  # bytes: small enough that the test's tensors span several chunks and parts


def shard(rank: int, flip: bool = False) -> dict[str, Any]:
    """What a DDP rank's store reports for one step: replicated weights equal on every rank,
    an RNG state that is not, and (``flip``) one bit of one weight flipped."""
    torch.manual_seed(0)
    model = {"a.weight": torch.randn(40), "b.weight": torch.randn(40), "c.bias": torch.randn(8)}
    if flip:
        model["b.weight"].view(torch.int32)[3] ^= 1 << 20
    state = {"model": model, "rng": torch.full((50,), rank, dtype=torch.uint8), "step": 7}
    flat = flatten(state)
    replicated = tuple(i for i, e in enumerate(flat.tensors) if e.key.startswith("/model/"))
    flat, blocks, gaps = place(flat, [Group("ddp:x", rank == 0, replicated)], CHUNK)
    data = bytearray(b"\xab" * flat.data_len)  # stale bytes: the gaps must be zeroed
    view = memoryview(data)
    for lo, hi in gaps:
        view[lo:hi] = bytes(hi - lo)
    for entry, src in zip(flat.tensors, flat.sources, strict=True):
        tensor_view(view, entry).copy_(src.reshape(entry.shape))
    seal(blocks, view)
    doc = parse_manifest(manifest_blob(flat, step=7, rank=rank, world_size=3,
                                       meta={"replicas": blocks}))
    hashes = verify.hash_chunks(view, CHUNK)
    return {"node_id": f"node{rank}", "epoch": "e", "rank": rank, "step": 7, "nbytes": len(data),
            "replicas": block_digests(doc, hashes, CHUNK), "_doc": doc}


def report(body: dict[str, Any]) -> Report:
    b = body["replicas"][0]
    return Report(body["rank"], body["node_id"], b["digest"], tuple(b["parts"]),
                  tuple(tuple(n) for n in b.get("names", ())))


def test_replicated_tensors_lie_first_in_a_chunk_aligned_block() -> None:
    doc = shard(0)["_doc"]
    (block,) = doc["meta"]["replicas"]
    assert (block["group"], block["lead"], block["lo"], block["chunk"]) == ("ddp:x", True, 0,
                                                                            CHUNK)
    offsets = {e["key"]: e["offset"] for e in doc["tensors"]}
    assert max(offsets[k] for k in ("/model/a.weight", "/model/b.weight", "/model/c.bias")) \
        < block["hi"] <= offsets["/rng"]
    # No padding: the per-rank bytes share the block's last chunk, whose block part the rank
    # hashed alone (its tail).
    assert offsets["/rng"] // CHUNK == block["hi"] // CHUNK and len(block["tail"]) == 16


def test_replicas_agree_although_their_other_state_differs() -> None:
    reports = {r: report(shard(r)) for r in range(3)}
    assert len({r.digest for r in reports.values()}) == 1
    assert compare("e", 7, "ddp:x", reports) is None


def test_the_rank_that_diverges_from_the_majority_is_named_with_its_tensor() -> None:
    reports = {0: report(shard(0)), 1: report(shard(1, flip=True)), 2: report(shard(2))}
    d = compare("e", 7, "ddp:x", reports)
    assert d is not None and d.ranks == (1,) and d.nodes == ("node1",) and d.majority
    assert d.members == 3 and any("b.weight" in t for t in d.tensors), d.tensors
    assert not any(t.startswith("/model/c.bias") for t in d.tensors)  # a chunk of its own


def test_two_replicas_that_differ_have_no_majority_both_are_named() -> None:
    d = compare("e", 7, "ddp:x", {0: report(shard(0)), 1: report(shard(1, flip=True))})
    assert d is not None and d.ranks == (0, 1) and not d.majority


def test_a_group_of_one_has_nothing_to_compare() -> None:
    assert compare("e", 7, "ddp:x", {1: report(shard(1, flip=True))}) is None


def test_a_step_whose_replicas_disagree_never_commits() -> None:
    tracker = CommitTracker()
    tracker.begin("e", base_step=6, world_size=3)
    for body in (shard(0), shard(1, flip=True)):
        tracker.handle("snap_verified", body)
    reply, _ = tracker.handle("snap_verified", shard(2))
    assert reply["committed"] == 6 and reply["dead"] == [7] and reply["disagreed"] == [7]
    (found,) = tracker.sdc.found
    assert found.ranks == (1,) and found.step == 7
    # Ranks without replicated state report no digests: nothing compared, the step commits.
    for rank in range(3):
        body = {**shard(rank), "step": 8}
        del body["replicas"]
        reply, _ = tracker.handle("snap_verified", body)
    assert reply["committed"] == 8 and "disagreed" not in reply
    assert tracker.sdc.checked == 1 and tracker.sdc.disagreed == 1


class Calls:
    def __init__(self, can_isolate: bool = True) -> None:
        self.directives: list[tuple[str, str, dict[str, Any]]] = []
        self.isolated: list[str] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._can_isolate = can_isolate

    def policy(self, action: str) -> CorruptionPolicy:
        def isolate(host: str, _reason: str, _evidence: dict[str, Any]) -> bool:
            if self._can_isolate:
                self.isolated.append(host)
            return self._can_isolate

        return CorruptionPolicy(
            action, direct=lambda n, a, d: self.directives.append((n, a, d)) or "id",
            isolate=isolate, host_of=lambda node: f"host-{node}",
            record=lambda t, _n, d: self.events.append((t, d)), coordinator_host="coord")


def divergence(epoch: str, rank: int = 1, flip_pair: bool = False) -> Any:
    if flip_pair:
        reports = {0: report(shard(0)), 1: report(shard(1, flip=True))}
    else:
        reports = {r: report(shard(r, flip=r == rank)) for r in range(3)}
    d = compare(epoch, 7, "ddp:x", reports)
    assert d is not None
    return d


def test_restart_kills_the_diverging_rank_and_isolates_a_host_named_again() -> None:
    calls = Calls()
    policy = calls.policy("restart")
    policy.handle(divergence("e1"))
    policy.handle(divergence("e1"))  # the next step of the same epoch: already acted on
    assert calls.directives == [("node1", "restart", {
        "ranks": [1], "reason": "silent data corruption in step 7"})]
    assert [(t, d["ranks"], d["action"]) for t, d in calls.events] == \
        [("corruption_detected", [1], "restart")]
    policy.handle(divergence("e2"))  # the same host, after the restart: isolated
    assert calls.isolated == ["host-node1"] and len(calls.directives) == 1
    assert calls.events[-1][1]["action"] == "isolate"


def test_no_majority_is_never_isolated_and_warn_only_records() -> None:
    calls = Calls()
    calls.policy("isolate").handle(divergence("e", flip_pair=True))
    assert calls.isolated == [] and [d["ranks"] for _, _, d in calls.directives] == [[0], [1]]
    calls = Calls()
    calls.policy("warn").handle(divergence("e"))
    assert calls.directives == [] and calls.isolated == []
    assert calls.events[0][1]["action"] == "warn" and calls.events[0][1]["majority"]


def test_isolate_without_a_detection_service_restarts_instead() -> None:
    calls = Calls(can_isolate=False)
    calls.policy("isolate").handle(divergence("e"))
    assert calls.events[0][1]["action"] == "restart" and len(calls.directives) == 1


def test_on_corruption_flag_is_checked() -> None:
    with pytest.raises(ConfigError, match="--on-corruption must be one of warn, restart, "
                                          "isolate, got 'reboot'"):
        FtrunOptions(state_dir=None, coordinator=None, hang_timeout_s=0,
                     heartbeat_interval_s=1, node_timeout_s=10, on_corruption="reboot")


def _mark_replicas(rank: int, store_path: str, out_dir: str) -> None:
    """One of two gloo ranks: what ftrun.rank.replicas marks as replicated in a DDP model's
    captured state, and in DTensors replicated or sharded over the two ranks."""
    import json

    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from ftrun.rank.replicas import groups
    from ftrun.rank.state import TrainingState

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4),
                                                            torch.nn.BatchNorm1d(4)))
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
        state = TrainingState(model, optimizer, None).capture(1, None)
        mesh = init_device_mesh("cpu", (2,))
        state["model"]["tp.replicated"] = distribute_tensor(torch.ones(3), mesh, [Replicate()])
        state["model"]["tp.sharded"] = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
        flat = flatten(state)
        found = {g.name: [g.lead, sorted(flat.tensors[i].key for i in g.indices)]
                 for g in groups(state, model, optimizer, flat)}
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(found, f)
    finally:
        dist.destroy_process_group()


def test_the_ranks_mark_what_ddp_and_replicated_dtensors_share(tmp_path: Any) -> None:
    import json

    import torch.multiprocessing as mp

    mp.spawn(_mark_replicas, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert found[0].keys() == found[1].keys()
    ddp = next(n for n in found[0] if n.startswith("ddp:"))
    params = ["/model/0.bias", "/model/0.weight", "/model/1.bias", "/model/1.weight"]
    optim = [f"/optim/state/{p}/{k}" for p in (p.removeprefix("/model/") for p in params)
             for k in ("exp_avg", "exp_avg_sq", "step")]
    # Parameters and their optimizer state; not the batch-norm buffers (running statistics
    # follow each rank's own batch), the RNG states or the step.
    assert found[0][ddp] == [True, sorted(params + optim)]
    assert found[1][ddp] == [False, sorted(params + optim)]
    (dtensor,) = set(found[0]) - {ddp}  # the sharded DTensor has no replica
    assert found[0][dtensor] == [True, ["/model/tp.replicated"]]
    assert found[1][dtensor] == [False, ["/model/tp.replicated"]]


def test_status_shows_the_comparison_and_a_finding() -> None:
    from test_status_detection import _doc, _node, _text

    doc = _doc([_node(0, "hosta"), _node(1, "hostb")], None)
    doc["snapshots"] = {"committed_step": 10, "stores": {}, "corruption": {
        "on_corruption": "restart", "checked_steps": 10, "disagreed_steps": 0, "findings": []}}
    assert "replicas agreed at 10 step(s)" in _text(doc)
    calls = Calls()
    calls.policy("restart").handle(divergence("e"))
    doc["snapshots"]["corruption"].update(disagreed_steps=1, findings=calls.events[0][1:])
    assert "SILENT CORRUPTION: replicas disagreed at 1 step(s), latest step 7: rank(s) [1], " \
           "restart" in _text(doc)
