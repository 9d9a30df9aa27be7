"""The data position across a change of world size: nothing skipped, nothing repeated.

Unit tests run ``ResumableDistributedSampler`` (and examples/train.py's step rule) the way
ranks do: W ranks take some steps, every rank keeps (epoch, consumed), then M ranks go on from
that position. What all of them trained on together must be the epoch's order, each position
once. The integration tests run examples/train.py under ftrun with FSDP2 on 4 and on 3 ranks.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from conftest import FULL_MATRIX, TRAIN, Procs, load_train, result_line
from torch.utils.data import DistributedSampler

import ftrun
from ftrun.rank.data import ResumableDistributedSampler

train = load_train()


def epoch_order(length: int, seed: int, epoch: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed + epoch)
    return torch.randperm(length, generator=gen).tolist()


def run_steps(samplers: list[ResumableDistributedSampler], steps: int | None,
              batch: int) -> tuple[list[int], int]:
    """Every rank takes ``batch`` indices per step (fewer in the epoch's last step), as a
    DataLoader with ``batch_size=batch`` would; ``steps=None``: to the epoch's end. Returns the
    indices all ranks took, in position order, and the positions consumed."""
    iters = [iter(s) for s in samplers]
    world = len(samplers)
    taken: list[list[int]] = [[] for _ in samplers]
    consumed = samplers[0].consumed
    for _ in itertools.count() if steps is None else range(steps):
        step = [list(itertools.islice(it, batch)) for it in iters]
        sizes = {len(b) for b in step}
        assert len(sizes) == 1, f"ranks got batches of different sizes {sizes}: DDP would hang"
        if not step[0]:
            break
        for rank, b in enumerate(step):
            taken[rank] += b
        consumed += len(step[0]) * world  # the contract: what every rank took, together
    # Rank r's j-th index sits at position r + j * world of the positions consumed here.
    in_order = [taken[j % world][j // world] for j in range(sum(map(len, taken)))]
    return in_order, consumed


def make(length: int, world: int, **kw: object) -> list[ResumableDistributedSampler]:
    return [ResumableDistributedSampler(length, world, r, **kw) for r in range(world)]


@pytest.mark.parametrize("length", [1, 7, 24, 25, 100])
@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_from_the_start_it_is_distributed_sampler(length: int, world: int, shuffle: bool,
                                                  drop_last: bool) -> None:
    for rank in range(world):
        for epoch in (0, 5):
            ours = ResumableDistributedSampler(list(range(length)), world, rank,
                                               shuffle=shuffle, seed=3, drop_last=drop_last)
            theirs = DistributedSampler(list(range(length)), world, rank, shuffle=shuffle,
                                        seed=3, drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)
            # A resume on the same world size goes on where DistributedSampler would be.
            for taken in (1, 2):
                if taken <= len(theirs):
                    ours.set_epoch(epoch, min(taken * world, length))
                    assert list(ours) == list(theirs)[taken:]


CHANGES = [(4, 3), (3, 4), (2, 5), (8, 3), (1, 4), (4, 1)]


@pytest.mark.parametrize(("old", "new"), CHANGES)
@pytest.mark.parametrize("batch", [1, 2, 3, 5])
@pytest.mark.parametrize("steps", [0, 1, 4])
def test_world_size_change_mid_epoch_skips_and_repeats_nothing(old: int, new: int, batch: int,
                                                               steps: int) -> None:
    # The rest of the epoch after the change divides by the new world size: no padding,
    # nothing dropped (the last batch is short when 11 does not divide by batch).
    length = steps * batch * old + 11 * new
    order = epoch_order(length, seed=7, epoch=2)
    before = make(length, old, seed=7, drop_last=True)
    for s in before:
        s.set_epoch(2)
    first, consumed = run_steps(before, steps, batch)
    assert consumed == steps * batch * old
    assert first == order[:consumed]  # the first positions of the order, nothing else

    after = make(length, new, seed=7, drop_last=True)
    for s in after:
        s.set_epoch(2, consumed)  # all the new ranks need: (epoch, consumed)
    rest, end = run_steps(after, None, batch)
    assert len(after[0]) * new == length - consumed
    assert end == length
    assert first + rest == order  # each position once, in order


@pytest.mark.parametrize(("old", "new"), CHANGES)
@pytest.mark.parametrize("batch", [2, 3])
def test_end_of_epoch_pads_or_drops_only_the_last_positions(old: int, new: int,
                                                            batch: int) -> None:
    length = 101  # 3 steps of 8 ranks take 72 (the change is mid-epoch); 101 is prime
    order = epoch_order(length, seed=0, epoch=0)
    for drop_last in (True, False):
        before = make(length, old, seed=0, drop_last=drop_last)
        first, consumed = run_steps(before, 3, batch)
        after = make(length, new, seed=0, drop_last=drop_last)
        for s in after:
            s.set_epoch(0, consumed)
        rest, end = run_steps(after, None, batch)
        left = (length - consumed) % new
        if drop_last:  # the last (rest % new) positions are left out, nothing else
            assert first + rest == order[:length - left]
        else:  # the order goes on from its start until every rank has as many
            pad = (new - left) % new
            assert first + rest == order + order[:pad]
        assert end == len(first) + len(rest)


def test_next_epoch_after_the_change_is_the_full_order() -> None:
    length = 30
    before = make(length, 4, seed=1)
    _, consumed = run_steps(before, 2, 2)
    after = make(length, 3, seed=1)
    for s in after:
        s.set_epoch(0, consumed)
    run_steps(after, None, 2)
    for s in after:
        s.set_epoch(1)
    assert run_steps(after, None, 2)[0] == epoch_order(length, 1, 1)


@pytest.mark.parametrize(("old", "new", "batch"), [
    (old, new, batch) for old, new in CHANGES for batch in (1, 3, 7, 8, 12)
    if batch >= max(old, new)  # train.py needs a sample per rank
])
def test_train_py_steps_span_epochs_and_survive_a_change(old: int, new: int,
                                                         batch: int) -> None:
    """examples/train.py: a global batch of any size, split over any number of ranks, runs on
    into the next epoch. Over a change at step 5 the samples are the stream's, once each."""
    length, seed = 17, 4
    stream = [i for e in range(12) for i in epoch_order(length, seed, e)]
    epoch = consumed = 0
    seen: list[int] = []
    for step in range(1, 12):
        world = old if step <= 5 else new
        ranks = [ResumableDistributedSampler(length, world, r, seed=seed) for r in range(world)]
        results = [train.step_indices(s, epoch, consumed, batch) for s in ranks]
        assert len({(e, c) for _, e, c in results}) == 1, "ranks disagree on the position"
        got: list[int] = []  # the step's samples in position order
        for j in range(batch):
            got.append(results[j % world][0][j // world])
        assert sum(len(r[0]) for r in results) == batch
        seen += got
        _, epoch, consumed = results[0]
        assert epoch * length + consumed == len(seen)
    assert seen == stream[:len(seen)]


def test_stream_crosses_epochs_and_accepts_a_position_past_the_end() -> None:
    s = ResumableDistributedSampler(5, 2, 1, shuffle=False)
    assert list(itertools.islice(s.stream(0, 3), 4)) == [4, 1, 3, 0]
    assert list(itertools.islice(s.stream(1, 3), 2)) == list(itertools.islice(s.stream(0, 8), 2))


def test_bad_positions_and_ranks_are_refused_with_the_fix() -> None:
    s = ResumableDistributedSampler(10, 2, 0)
    with pytest.raises(ValueError, match=r"consumed must be in 0\.\.10.*divmod"):
        s.set_epoch(0, 11)
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        s.set_epoch(-1)
    with pytest.raises(ValueError, match="0 <= rank < num_replicas"):
        ResumableDistributedSampler(10, 2, 2)
    with pytest.raises(ValueError, match="at least one"):
        ResumableDistributedSampler([], 1, 0)
    s.set_epoch(0, 10)  # the epoch's end: nothing left
    assert list(s) == [] and len(s) == 0


def test_exported_from_ftrun() -> None:
    assert ftrun.ResumableDistributedSampler is ResumableDistributedSampler
    assert "ResumableDistributedSampler" in ftrun.__all__


# --------------------------------------------------------------------------------------------
# examples/train.py --fsdp under ftrun
# --------------------------------------------------------------------------------------------

STEPS, BATCH, SAMPLES = 5, 12, 40  # 60 samples: the second epoch starts in step 4
SMALL = ("--layers", "1", "--dim", "32")


def train_fsdp(procs: Procs, nproc: int, log: Path, steps: int = STEPS,
               launcher: tuple[str, ...] = (), script: tuple[str, ...] = ()) -> str:
    """Run examples/train.py --fsdp on ``nproc`` ranks to the end; its output."""
    proc = procs.ftrun("--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0",
                       *launcher, TRAIN, "--fsdp", "--steps", str(steps), "--batch", str(BATCH),
                       "--samples", str(SAMPLES), *SMALL, "--sample-log", str(log), *script,
                       name=f"fsdp{nproc}")
    code = procs.wait(proc, 240)
    out = procs.output(proc)
    assert code == 0, out[-5000:]
    line = result_line(out)
    assert line.startswith(f"ftrun-example: step={steps} loss=") and "params_xxh3=" in line
    return out


def samples_in_position_order(log: Path) -> list[int]:
    """The sample log's indices, step by step, each step's in position order."""
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    steps = sorted({r["step"] for r in rows})
    assert steps == list(range(1, STEPS + 1)), steps
    seen = []
    for step in steps:
        ranks = {r["rank"]: r for r in rows if r["step"] == step}
        [world] = {r["world_size"] for r in ranks.values()}
        assert sorted(ranks) == list(range(world)), f"step {step}: ranks {sorted(ranks)}"
        seen += [ranks[j % world]["indices"][j // world] for j in range(BATCH)]
    return seen


STREAM = [i for e in range(2) for i in epoch_order(SAMPLES, 0, e)]


@pytest.mark.integration
@pytest.mark.parametrize("nproc", [4, 3])
def test_train_py_fsdp_completes(procs: Procs, state_dir: Path, tmp_path: Path,
                                 nproc: int) -> None:
    log = tmp_path / "samples.jsonl"
    train_fsdp(procs, nproc, log)
    # The ranks trained on their shares of the stream of epoch orders, nothing else.
    assert samples_in_position_order(log) == STREAM[:STEPS * BATCH]


@pytest.mark.integration
@pytest.mark.usefixtures("exact_steps")
@FULL_MATRIX  # ~60 s; fewer ranks resuming: test_reshard_integ, the data order: the unit tests above
def test_train_py_fsdp_goes_on_with_the_data_on_fewer_ranks(procs: Procs, state_dir: Path,
                                                            tmp_path: Path) -> None:
    """4 ranks persist step 2; a job of 3 ranks resumes it: steps 3.. read the samples the
    4 ranks would have read next, across the epoch's end, none of the earlier ones."""
    log, ckpt = tmp_path / "samples.jsonl", tmp_path / "ckpt"
    persist, every = ("--persist-dir", str(ckpt)), ("--snapshot-every", "1")
    train_fsdp(procs, 4, log, steps=2, launcher=persist, script=every)
    out = train_fsdp(procs, 3, log, launcher=persist, script=every)
    assert "resumed from step 2 (epoch 0, 24 samples consumed in it)" in out, out[-5000:]
    assert samples_in_position_order(log) == STREAM[:STEPS * BATCH]
