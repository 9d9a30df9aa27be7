"""bench/ettr.py: the ETTR simulator on small traces whose answer is computed by hand."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ettr", ROOT / "bench" / "ettr.py")
assert _spec is not None and _spec.loader is not None
ettr = importlib.util.module_from_spec(_spec)
sys.modules["ettr"] = ettr  # dataclasses look the module up by name
_spec.loader.exec_module(ettr)


def policy(**kw):
    """Saves every 90 s of training blocking 10 s; every fault: 2 s to detect, 8 to recover."""
    args = dict(name="p", interval_s=90.0, save_block_s=10.0, save_lag_s=0.0,
                detect_s=dict.fromkeys(ettr.KINDS, 2.0), recover_s=dict.fromkeys(ettr.KINDS, 8.0))
    args.update(kw)
    return ettr.Policy(**args)


def total(o) -> float:
    return o.useful + sum(getattr(o, k) for k in ettr.LOSSES)


def test_no_faults_ettr_is_one_minus_the_save_overhead():
    o = ettr.simulate([], policy(), 1000.0)
    assert o.ettr == 0.9 == 90 / (90 + 10)
    assert (o.checkpoint, o.recompute, o.detection, o.recovery) == (100.0, 0, 0, 0)


def test_one_crash_gives_the_hand_computed_ettr():
    # Saves end at 100 (90 s trained) and 200 (180 s); the crash at 250 loses the 50 s trained
    # since; down 250-260; then 740 s: 7 cycles (630 s trained, 70 s of saves) and 40 s more.
    o = ettr.simulate([ettr.Event(250.0, ettr.RANK_CRASH)], policy(), 1000.0)
    assert o.ettr == 0.85
    assert (o.useful, o.checkpoint, o.recompute, o.detection, o.recovery) == (
        850.0, 90.0, 50.0, 2.0, 8.0)
    assert o.faults == 1 and total(o) == 1000.0
    # a save that becomes restorable 60 s after it ends: the one ending at 200 is not yet
    late = ettr.simulate([ettr.Event(250.0, ettr.RANK_CRASH)], policy(save_lag_s=60.0), 1000.0)
    assert late.recompute == 140.0 and late.useful == 760.0


def test_corruption_found_at_the_next_snapshot_and_a_slow_rank():
    detect = dict.fromkeys(ettr.KINDS, 2.0) | {ettr.SILENT_CORRUPTION: None,
                                              ettr.SLOW_RANK: 40.0}
    p = policy(detect_s=detect, slow_speed=0.5)
    # corruption at 250: found when the next snapshot ends (300), back to the one at 200
    o = ettr.simulate([ettr.Event(250.0, ettr.SILENT_CORRUPTION)], p, 1000.0)
    assert (o.detection, o.recompute, o.useful) == (50.0, 50.0, 810.0)
    # slow rank at 250, found 40 s later at half speed: a 20 s stall, then stop at 290 (250 s
    # trained, 180 restorable), recovered by 298; 702 s more train 632.
    o = ettr.simulate([ettr.Event(250.0, ettr.SLOW_RANK)], p, 1000.0)
    assert (o.detection, o.recompute, o.recovery, o.useful) == (20.0, 70.0, 8.0, 812.0)
    assert total(o) == 1000.0 and o.faults == 1


def test_a_second_host_loss_on_the_peer_restores_the_persisted_copy():
    p = policy(persist_every=3, memory_lost_p=1.0, disk_restore_s=5.0)
    events = [ettr.Event(450.0, ettr.HOST_LOSS, "host", 0.0),
              ettr.Event(455.0, ettr.HOST_LOSS, "host", 0.0)]
    o = ettr.simulate(events, p, 1000.0)
    # at 450: 410 trained, snapshot 360 in memory, 270 persisted; the second loss during the
    # recovery takes the memory copy: back to 270 (90 more recomputed), 5 s from disk
    assert o.memory_lost == 1
    assert (o.recompute, o.persist, o.detection, o.recovery, o.useful) == (
        140.0, 5.0, 4.0, 11.0, 750.0)
    assert total(o) == 1000.0
    # not the peer (u above p): the memory copy survives
    o = ettr.simulate([events[0], ettr.Event(455.0, ettr.HOST_LOSS, "host", 0.9)],
                      policy(persist_every=3, memory_lost_p=0.5, disk_restore_s=5.0), 1000.0)
    assert o.memory_lost == 0 and o.recompute == 50.0


def test_interval_search_finds_the_analytic_optimum():
    # Poisson crashes, MTBF M; restart R (a crash during it starts it over); save C. Expected
    # wall time per segment of tau trained + C saved: M e^(R/M) (e^((tau+C)/M) - 1) (Daly).
    m, r, c, horizon = 1000.0, 20.0, 5.0, 6e5

    def analytic(tau: float) -> float:
        return tau / (m * math.exp(r / m) * math.expm1((tau + c) / m))

    taus = [10 + 0.1 * i for i in range(3000)]
    best = max(taus, key=analytic)
    rng = random.Random(7)
    draws = []
    for _ in range(2):
        t, evs = rng.expovariate(1 / m), []
        while t < horizon:
            evs.append(ettr.Event(t, ettr.RANK_CRASH))
            t += rng.expovariate(1 / m)
        draws.append(evs)
    zero = dict.fromkeys(ettr.KINDS, 0.0)
    found = ettr.best_interval(
        draws, lambda x: policy(interval_s=x, save_block_s=c, detect_s=zero,
                                recover_s=dict.fromkeys(ettr.KINDS, r)), horizon)
    assert abs(found - best) / best < 0.2, (found, best)
    assert analytic(found) > analytic(best) - 0.002
    assert abs(ettr.daly_s(c, m) - best) / best < 0.05  # the cross-check printed beside it


def test_llama3_trace_and_projection_are_deterministic_and_add_up():
    tr = ettr.llama3_trace()
    assert tr.counts == {ettr.HOST_LOSS: 344, ettr.RANK_CRASH: 56, ettr.HANG: 7,
                         ettr.SLOW_RANK: 6, ettr.SILENT_CORRUPTION: 6}
    assert sum(n for _, n, _, _ in ettr.LLAMA3_CAUSES) == 419
    assert tr.mtbf_s(16384) == pytest.approx(54 * 86400 / 419)
    costs = ettr.load_costs(None)
    a = ettr.project(tr, costs, 1024, 2, seed=3, horizon_s=tr.duration_s)
    b = ettr.project(tr, costs, 1024, 2, seed=3, horizon_s=tr.duration_s)
    assert a.as_dict() == b.as_dict()
    d = tr.draw(16384, tr.duration_s, random.Random(1))
    for p in (ettr.ftrun_policy(costs, 16384, 60.0), ettr.baseline_policy(costs, 16384, 300.0)):
        o = ettr.simulate(d, p, tr.duration_s)
        assert total(o) == pytest.approx(tr.duration_s) and 0 < o.ettr < 1


def test_bad_trace_and_cost_files_get_clear_errors(tmp_path, capsys):
    cases = {
        "kind.csv": ("time_s,kind,scope\n10,meteor,host\n", "unknown kind 'meteor'"),
        "scope.csv": ("time_s,kind,scope\n10,host_loss,rank\n", "scope 'rank' does not fit"),
        "header.csv": ("10,host_loss,host\n", "needs a header line"),
        "time.csv": ("time_s,kind,scope\nsoon,hang,rank\n", "time_s must be a number"),
        "late.json": (json.dumps({"gpus": 8, "duration_s": 5,
                                  "events": [{"time_s": 9, "kind": "hang", "scope": "rank"}]}),
                      "at or after the trace's end"),
        "nogpus.json": (json.dumps({"duration_s": 50, "events": []}), "'gpus' in the JSON"),
        "broken.json": ("{", "not JSON"),
        "trace.txt": ("", "name it .json or .csv"),
    }
    for name, (text, message) in cases.items():
        f = tmp_path / name
        f.write_text(text)
        with pytest.raises(ettr.EttrError, match=message.replace("(", r"\(")):
            ettr.load_trace(f, gpus=8 if name.endswith(".csv") else None,
                            duration_s=100.0 if name.endswith(".csv") else None)
    assert ettr.main(["--trace", str(tmp_path / "kind.csv"), "--trace-gpus", "8",
                      "--trace-days", "1"]) == 2
    assert "unknown kind 'meteor'" in capsys.readouterr().err
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"base_cold_restart": 300}))
    assert ettr.main(["--costs", str(costs), "--gpus", "1024", "--runs", "1"]) == 2
    assert "unknown figure 'base_cold_restart'" in capsys.readouterr().err


def test_a_trace_file_replayed_and_costs_overridden(tmp_path, capsys):
    f = tmp_path / "t.csv"
    f.write_text("time_s,kind,scope\n3600,host_loss,host\n7200,rank_crash,rank\n"
                 "9000,hang,rank\n")
    costs = tmp_path / "c.json"
    costs.write_text(json.dumps({"base_cold_restart_s": 300}))
    assert ettr.main(["--trace", str(f), "--trace-gpus", "64", "--trace-days", "0.5",
                      "--replay", "--costs", str(costs), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (size,) = out["sizes"]
    assert size["gpus"] == 64 and size["ftrun"]["faults_mean"] == 3
    assert size["baseline"]["ettr_mean"] < size["ftrun"]["ettr_mean"] < 1
    restart = next(c for c in out["costs"] if c["name"] == "base_cold_restart_s")
    assert (restart["value"], restart["default"]) == (300, 12.08)


@pytest.mark.parametrize("world, mtbf_gpu_h", [(16384, 50700.0), (1024, 50700.0), (8, 50700.0),
                                               (16384, 0.0)])
def test_auto_interval_is_the_cadences_rule(world: int, mtbf_gpu_h: float):
    """The simulator's every='auto' interval is what ftrun/rank/cadence.py picks for the same
    snapshot cost and failure rate, to within one step."""
    from ftrun.rank.cadence import Cadence

    costs = {f.name: float(f.value) for f in ettr.FIGURES} | {"ftrun_snapshot_block_s": 0.114}
    mtbf_s = mtbf_gpu_h * 3600 / world if mtbf_gpu_h else math.inf
    plain = 0.5
    cadence = Cadence("auto", gpu_mtbf_h=mtbf_gpu_h)
    for step in range(1, 13):
        cadence.observe(plain + (0.114 if cadence._last_due else 0.0))
        cadence.mark(cadence.due(step))
    expected = ettr.auto_interval_s(costs, mtbf_s) if mtbf_gpu_h else 0.114 / 0.03
    assert abs(cadence.wanted(world) * plain - expected) <= plain, (cadence.wanted(world), expected)


def test_erasure_coding_row_pays_the_rebuild_and_loses_memory_only_past_m():
    """The third launcher row (--redundancy ec:K+M): a lost host's recovery adds the rebuild
    of its state; with M = 1 a second loss among the K other nodes of its group takes the
    memory copy, with M >= 2 none does."""
    costs = ettr.load_costs(None)
    gpus = 1024
    nodes = gpus / costs["gpus_per_node"]
    plain = ettr.ftrun_policy(costs, gpus, 60.0)
    coded = ettr.ftrun_policy({**costs, "ftrun_ec_k": 4.0, "ftrun_ec_m": 1.0}, gpus, 60.0,
                              ec=True)
    node_gb = costs["gpus_per_node"] * costs["state_gb_per_gpu"]
    extra = node_gb / costs["ftrun_ec_rebuild_gbps"]
    assert coded.recover_s[ettr.HOST_LOSS] == pytest.approx(
        plain.recover_s[ettr.HOST_LOSS] + extra)
    assert coded.recover_s[ettr.RANK_CRASH] == plain.recover_s[ettr.RANK_CRASH]
    assert coded.memory_lost_p == pytest.approx(4 / (nodes - 1))
    assert plain.memory_lost_p == pytest.approx(1 / (nodes - 1))
    two = ettr.ftrun_policy({**costs, "ftrun_ec_m": 2.0}, gpus, 60.0, ec=True)
    assert two.memory_lost_p == 0.0 and two.name == "ftrun, ec:4+2"
    r = ettr.project(ettr.llama3_trace(), costs, 1024, 1, seed=0,
                     horizon_s=ettr.llama3_trace().duration_s)
    assert r.as_dict()["ftrun_ec"]["name"] == "ftrun, ec:4+2" and 0 < r.ftrun_ec.mean < 1
