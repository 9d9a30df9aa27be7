"""The control-plane wire format: round trips, authentication and validation."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any

import pytest

from ftrun import protocol
from ftrun.errors import AuthError, ProtocolError

SECRET = b"s" * 32
JOB = "job-1"

WORKER = {"local_rank": 0, "rank": 4, "pid": 1234, "state": "healthy", "exitcode": None}
HEARTBEAT = {
    "node_id": "host-a/99",
    "host": "host-a",
    "pid": 99,
    "state": "healthy",
    "group_rank": 2,
    "group_world_size": 4,
    "restarts": 1,
    "max_restarts": 3,
    "workers": [WORKER, {**WORKER, "local_rank": 1, "rank": 5, "pid": None, "exitcode": 1,
                         "state": "failed"}],
    "last_error": None,
    "extra": {"anything": [1, 2, {"x": None}]},
}

EXAMPLES: dict[str, dict[str, Any]] = {
    "hello": {"node_id": "host-a/99", "host": "host-a", "pid": 99},
    "heartbeat": HEARTBEAT,
    "event": {"node_id": "host-a/99", "type": "restart", "data": {"attempt": 1}},
    "bye": {"node_id": "host-a/99", "state": "succeeded", "exitcode": 0},
    "keepalive": {"node_id": "host-a/99", "same": 3, "acked": ["0123abcd"]},
    "status_request": {"nodes": "problems", "match": "host-a", "offset": 0, "limit": 64},
    "status_reply": {"doc": {"version": 1, "nodes": []}},
    "events_request": {"since": 3},
    "events_reply": {"events": [{"seq": 4, "type": "x"}]},
    "error": {"message": "nope"},
    "ack": {},
    "snap_epoch": {"node_id": "host-a/99", "epoch": "e1", "base_step": 4, "world_size": 4},
    "snap_verified": {"node_id": "host-a/99", "epoch": "e1", "rank": 2, "step": 5,
                      "nbytes": 1024},
    "commit_query": {"epoch": "e1"},
    "persist_request": {"node_id": "host-a/99", "epoch": "e1", "reason": "SIGUSR1",
                        "final": False},
    "commit_info": {"epoch": "e1", "committed": 5, "known": True, "targets": [3, 5],
                    "final": None},
    "store_report": {"node_id": "host-a/99", "bytes": 4096, "segments": 4,
                     "persisted_step": None, "ranks": [0, 1], "replicas": 2,
                     "replica_addr": "10.0.0.1:40001", "replica_sent": 7,
                     "replica_superseded": 1, "replica_abandoned": 0},
    "snap_staged": {"rank": 1, "buffer": 0, "step": 5, "epoch": "e1"},
    "snap_done": {"rank": 1, "buffer": 0, "step": 5, "ok": True, "committed": 4},
    "snap_claim": {"rank": 1, "buffer": 1, "epoch": "e1", "need_committed": 5},
    "snap_claim_reply": {"ok": False, "committed": 4},
    "snap_flush": {"rank": 1},
    "snap_restored": {"rank": 1, "epoch": "e1", "step": 4, "world_size": 4},
    "store_persist": {"reason": "SIGTERM"},
    "catalog_request": {"rank": 2, "hashes": True, "replicas": True},
    "catalog_reply": {"node_id": "h/1", "records": [{"segment": "s", "rank": 2, "step": 3}]},
    "replica_plan": {"replicas": 2, "members": 4,
                     "peers": [{"node_id": "host-b/7", "addr": "10.0.0.2:40001"}]},
    "replica_begin": {"origin": "host-a/99", "epoch": "e1", "rank": 2, "step": 5,
                      "data_len": 9 << 20, "chunk_size": 4 << 20, "n_tensors": 3},
    "replica_ready": {"have": False},
    "replica_chunk": {"origin": "host-a/99", "rank": 2, "step": 5, "chunk": 1},
    "replica_ack": {"rank": 2, "step": 5, "chunk": 1, "ok": False,
                    "reason": "chunk 1 refused: hash mismatch"},
    "replica_end": {"origin": "host-a/99", "rank": 2, "step": 5},
    "replica_done": {"rank": 2, "step": 5, "verified": True},
    "replica_verified": {"node_id": "host-b/7", "origin": "host-a/99", "epoch": "e1",
                         "rank": 2, "step": 5},
    "replica_dropped": {"node_id": "host-b/7", "origin": "host-a/99", "epoch": "e1",
                        "rank": 2, "step": 3},
    "holdings_request": {},
    "holdings_reply": {"node_id": "h/1", "records": [{"segment": "s", "rank": 2, "step": 3,
                                                      "world_size": 4}]},
    "shard_meta_request": {"segment": "s", "step": 3, "epoch": "e1"},
    "shard_meta": {"data_len": 9 << 20, "chunk_size": 4 << 20},
    "shard_read_request": {"segment": "s", "step": 3, "epoch": "e1", "first": 0, "count": 2},
    "shard_data": {"first": 0, "count": 2},
    "stores_request": {},
    "coordinator_moved": {"endpoint": "10.0.0.2:4100", "term": 7},
    "stores_reply": {"stores": [{"node_id": "host-b/7", "addr": "10.0.0.2:40002"}]},
    "coll_report": {"node_id": "host-a/99", "host": "host-a", "rank": 3, "world_size": 8,
                    "restart": 0, "pid": 99, "backend": "gloo", "seq": 12, "interval_s": 0.02,
                    "groups": [{"pg": "0", "size": 8, "enqueued": 41, "completed": 40,
                                "waiting_s": 1.25, "op": "gloo:all_reduce", "bytes": 4096,
                                "done": [[39, 0.04], [40, 0.06]]}]},
    "coll_summary": {"node_id": "host-a/99", "nodes": ["host-a/99", "host-b/7"], "restart": 0,
                     "interval_s": 0.02, "seq": 4, "world": "10.0.0.1:29500",
                     "groups": [{"pg": "0", "size": 16, "members": 8, "ops": [[40, 0.06]],
                                 "classes": [{"enqueued": 41, "completed": 40, "count": 7,
                                              "ranks": [0, 1, 2, 3, 4, 5, 6], "waiting": 7,
                                              "waiting_min_s": 1.0, "waiting_max_s": 1.3,
                                              "op": "gloo:all_reduce"},
                                             {"enqueued": 40, "completed": 40, "count": 1,
                                              "ranks": [7],
                                              "elsewhere": [[7, "1", 3, 1.1]]}]}],
                     "roster": [[0, "host-a/99", "host-a"]], "silent": [[9, 2.5]],
                     "left": [12]},
    "directives": {"directives": [{"id": "d1", "action": "restart",
                                   "data": {"ranks": [3], "reason": "hang"}}]},
    "probe": {"size": 1 << 20},
    "probe_ack": {"size": 1 << 20},
    "probe_result": {"node_id": "host-a/99", "host": "host-a", "id": "d2",
                     "results": [{"peer": "host-b/7", "host": "host-b", "rtt_s": 0.0004,
                                  "mb_s": 1100.5}, {"peer": "host-c/8", "host": "host-c",
                                                   "rtt_s": None, "mb_s": None,
                                                   "error": "timeout"}]},
    "fault_corrupt": {"rank": 2},
    "rank_abort": {"generation": 1, "reason": "rank 2 failed"},
    "rank_world": {"generation": 1, "env": {"RANK": "0", "MASTER_PORT": "29500"}},
    "rank_exit": {"generation": 1, "reason": "no restarts left"},
    "fault_reply": {"segment": "s", "step": 3, "offset": 100},
    "aggregate": {"node_id": "host-a/99",
                  "heartbeats": [{**HEARTBEAT, "node_id": "host-b/7", "plan": 4,
                                  "aggr_addr": "10.0.0.2:40003"}],
                  "keepalives": [{"node_id": "host-c/8", "same": 3, "plan": 4}]},
    "aggregate_reply": {"members": [{"node_id": "host-c/8", "directives": [
        {"id": "plan-5", "action": "aggregate",
         "data": {"plan": 5, "via": "", "addr": "", "group": 1}}]}]},
    "survey_request": {"key": "10.0.0.1:29500/1/8", "offset": 0},
    "survey_reply": {"ready": True, "records": [{"node": "h/1", "addr": "10.0.0.2:40002",
                                                 "segment": "s", "rank": 2, "step": 3}],
                     "lost": ["h/2"], "next": 1000},
}


def sign(header: dict[str, Any] | bytes, secret: bytes = SECRET) -> list[bytes]:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return [raw, hmac.new(secret, raw, hashlib.sha256).digest()]


def header(kind: str = "hello", body: dict[str, Any] | None = None, **over: Any) -> dict[str, Any]:
    h = {"v": protocol.VERSION, "kind": kind, "job": JOB, "sender": "t", "ts": time.time(),
         "id": "abcd", "sn": "5e55", "n": 1, "body": EXAMPLES[kind] if body is None else body}
    h.update(over)
    return h


def test_every_kind_has_an_example() -> None:
    assert set(EXAMPLES) == set(protocol.BODIES)


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_round_trip(kind: str) -> None:
    frames = protocol.encode(kind, EXAMPLES[kind], secret=SECRET, job=JOB, sender="me")
    assert len(frames) == 2 and len(frames[1]) == 32
    msg = protocol.decode(frames, secret=SECRET, job=JOB)
    assert (msg.kind, msg.job, msg.sender, msg.body) == (kind, JOB, "me", EXAMPLES[kind])
    assert abs(msg.ts - time.time()) < 5
    int(msg.id, 16)


def test_ids_are_random() -> None:
    a = protocol.decode(protocol.encode("ack", {}, secret=SECRET, job=JOB, sender="x"),
                        secret=SECRET, job=JOB)
    b = protocol.decode(protocol.encode("ack", {}, secret=SECRET, job=JOB, sender="x"),
                        secret=SECRET, job=JOB)
    assert a.id != b.id


def test_wrong_secret_is_auth_error() -> None:
    frames = protocol.encode("hello", EXAMPLES["hello"], secret=b"other" * 8, job=JOB,
                             sender="x")
    with pytest.raises(AuthError, match="not signed with this job's secret"):
        protocol.decode(frames, secret=SECRET, job=JOB)


def test_tampered_header_is_auth_error() -> None:
    header_bytes, mac = protocol.encode("bye", EXAMPLES["bye"], secret=SECRET, job=JOB,
                                        sender="x")
    tampered = header_bytes.replace(b'"exitcode":0', b'"exitcode":1')
    assert tampered != header_bytes
    with pytest.raises(AuthError):
        protocol.decode([tampered, mac], secret=SECRET, job=JOB)


@pytest.mark.parametrize("frames", [
    [],
    [b"garbage"],
    [b"a", b"b", b"c"],
    [b"{}", b""],
    [b"\x00" * 10, b"\xff" * 32],
])
def test_garbage_frames(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        protocol.decode(frames, secret=SECRET, job=JOB)


def test_truncated_mac_and_header() -> None:
    header_bytes, mac = protocol.encode("hello", EXAMPLES["hello"], secret=SECRET, job=JOB,
                                        sender="x")
    with pytest.raises(ProtocolError, match="MAC frame is 16 bytes"):
        protocol.decode([header_bytes, mac[:16]], secret=SECRET, job=JOB)
    with pytest.raises(AuthError):
        protocol.decode([header_bytes[:-5], mac], secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError, match="got 1"):
        protocol.decode([header_bytes], secret=SECRET, job=JOB)


def test_authentic_but_not_json() -> None:
    with pytest.raises(ProtocolError, match="not UTF-8 JSON"):
        protocol.decode(sign(b"{not json"), secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError, match="not UTF-8 JSON"):
        protocol.decode(sign(b"\xff\xfe"), secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError, match="object"):
        protocol.decode(sign(b"[1, 2]"), secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError):
        protocol.decode(sign(b"[" * 100_000), secret=SECRET, job=JOB)


def test_oversize_rejected_before_mac() -> None:
    big = b"x" * protocol.MAX_MESSAGE_BYTES
    with pytest.raises(ProtocolError, match="bytes"):
        protocol.decode([big, b"\0" * 32], secret=SECRET, job=JOB)
    body = {"events": [{"m": "x" * 60_000}] * 20}  # each string fine, the whole too big
    with pytest.raises(ProtocolError, match="max"):
        protocol.encode("events_reply", body, secret=SECRET, job=JOB, sender="x")


def test_wrong_version_names_both() -> None:
    newer = protocol.VERSION + 1
    with pytest.raises(ProtocolError, match=rf"version {newer}.*speaks version "
                                            rf"{protocol.VERSION}.*another ftrun release"):
        protocol.decode(sign(header(v=newer)), secret=SECRET, job=JOB)
    # A version 3 peer (no session or counter in its header) is told apart by its version,
    # not by a missing field.
    old = header(v=3)
    del old["sn"], old["n"]
    with pytest.raises(ProtocolError, match=rf"version 3.*speaks version {protocol.VERSION}"):
        protocol.decode(sign(old), secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError, match="version None"):
        h = header()
        del h["v"]
        protocol.decode(sign(h), secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError, match="version"):
        protocol.decode(sign(header(v=True)), secret=SECRET, job=JOB)


def test_wrong_job() -> None:
    with pytest.raises(ProtocolError, match="for job 'other'"):
        protocol.decode(sign(header(job="other")), secret=SECRET, job=JOB)


def test_unknown_kind() -> None:
    with pytest.raises(ProtocolError, match="unknown message kind"):
        protocol.decode(sign(header(kind="shutdown", body={})), secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError, match="unknown message kind"):
        protocol.encode("shutdown", {}, secret=SECRET, job=JOB, sender="x")


def test_header_fields_checked() -> None:
    with pytest.raises(ProtocolError, match="unknown field"):
        protocol.decode(sign(header(extra=1)), secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError, match="header.ts"):
        protocol.decode(sign(header(ts="now")), secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError, match="id"):
        protocol.decode(sign(header(id="not hex!")), secret=SECRET, job=JOB)
    h = header()
    del h["sender"]
    with pytest.raises(ProtocolError, match="sender"):
        protocol.decode(sign(h), secret=SECRET, job=JOB)
    for field in ("sn", "n"):
        h = header()
        del h[field]
        with pytest.raises(ProtocolError, match=f"lacks required field '{field}'"):
            protocol.decode(sign(h), secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError, match="sn"):
        protocol.decode(sign(header(sn="not hex!")), secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError, match="counter n=0"):
        protocol.decode(sign(header(n=0)), secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError, match="header.n must be int"):
        protocol.decode(sign(header(n=1.5)), secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError, match="header.body must be an object"):
        protocol.decode(sign(header(body=[1])), secret=SECRET, job=JOB)


@pytest.mark.parametrize(("kind", "body", "match"), [
    ("hello", {**EXAMPLES["hello"], "admin": True}, "unknown field"),
    ("hello", {"node_id": "n", "host": "h"}, "lacks required field 'pid'"),
    ("hello", {"node_id": "n", "host": "h", "pid": "12"}, "pid must be int"),
    ("hello", {"node_id": "n", "host": "h", "pid": True}, "pid must be int"),
    ("hello", {"node_id": "n", "host": "h", "pid": 1.5}, "pid must be int"),
    ("hello", {"node_id": None, "host": "h", "pid": 1}, "node_id must be string"),
    ("status_request", {"x": 1}, "unknown field"),
    ("events_request", {"since": "3"}, "since must be int"),
    ("event", {"node_id": "n", "type": "t", "data": [1]}, "data must be object"),
    ("event", {"node_id": "n", "type": "t", "data": {"s": "x" * 70_000}}, "string of"),
    ("events_reply", {"events": [{}] * (protocol.MAX_LIST_ITEMS + 1)}, "list of"),
    ("events_reply", {"events": [1]}, "must be object"),
    ("heartbeat", {**HEARTBEAT, "group_rank": "0"}, "group_rank must be int or null"),
    ("heartbeat", {**HEARTBEAT, "workers": {}}, "workers must be a list"),
    ("bye", {"node_id": "n", "state": "failed", "exitcode": None}, "exitcode must be int"),
])
def test_body_validation(kind: str, body: dict[str, Any], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        protocol.decode(sign(header(kind, body)), secret=SECRET, job=JOB)
    with pytest.raises(ProtocolError, match=match):
        protocol.encode(kind, body, secret=SECRET, job=JOB, sender="x")


@pytest.mark.parametrize(("worker", "match"), [
    ({k: v for k, v in WORKER.items() if k != "rank"}, r"workers\[0\] lacks required field 'rank'"),
    ({**WORKER, "rank": "0"}, r"workers\[0\].rank must be int"),
    ({**WORKER, "exitcode": "1"}, r"workers\[0\].exitcode must be int or null"),
    ({**WORKER, "color": "red"}, r"workers\[0\] has unknown field"),
    ("worker", r"workers\[0\] must be an object"),
])
def test_nested_worker_validation(worker: Any, match: str) -> None:
    body = {**HEARTBEAT, "workers": [worker]}
    with pytest.raises(ProtocolError, match=match):
        protocol.decode(sign(header("heartbeat", body)), secret=SECRET, job=JOB)


def test_optional_fields_may_be_absent() -> None:
    body = {k: v for k, v in HEARTBEAT.items() if k != "extra"}
    msg = protocol.decode(sign(header("heartbeat", body)), secret=SECRET, job=JOB)
    assert "extra" not in msg.body
    msg = protocol.decode(sign(header("events_request", {})), secret=SECRET, job=JOB)
    assert msg.body == {}


def test_stale_and_future_timestamps() -> None:
    frames = protocol.encode("ack", {}, secret=SECRET, job=JOB, sender="x")
    protocol.decode(frames, secret=SECRET, job=JOB, now=time.time() + 200)
    with pytest.raises(ProtocolError, match="clock"):
        protocol.decode(frames, secret=SECRET, job=JOB, now=time.time() + 400)
    with pytest.raises(ProtocolError, match="clock"):
        protocol.decode(sign(header(ts=time.time() + 1000)), secret=SECRET, job=JOB)


def test_endpoints() -> None:
    assert protocol.split_endpoint("node1:29400") == ("node1", 29400)
    assert protocol.split_endpoint("[::1]:5") == ("::1", 5)
    assert protocol.join_endpoint("::1", 5) == "[::1]:5"
    assert protocol.zmq_url("10.0.0.1:80") == "tcp://10.0.0.1:80"
    for bad in ("node1", "node1:", ":80", "h:99999", "h:x"):
        with pytest.raises(Exception, match="HOST:PORT"):
            protocol.split_endpoint(bad)


# -- binary frames beside the header -----------------------------------------------------------


def test_data_frames_round_trip_and_reply_id() -> None:
    data = [b"\x00\x01" * 1000, b"", bytes(range(256))]
    frames = protocol.encode("snap_flush", {"rank": 3}, secret=SECRET, job=JOB, sender="x",
                             re="abc123", data=data)
    assert len(frames) == 2 + len(data)
    msg = protocol.decode(frames, secret=SECRET, job=JOB)
    assert [bytes(f) for f in msg.frames] == data
    assert msg.re == "abc123" and msg.body == {"rank": 3}
    # The MAC is over the header alone; the header names each frame's keyed digest.
    assert frames[1] == hmac.new(SECRET, frames[0], hashlib.sha256).digest()
    doc = json.loads(frames[0])
    assert doc["fd"] == protocol.frame_digests(SECRET, doc["id"], data)
    assert len(doc["fd"]) == 3 and all(len(d) == 32 for d in doc["fd"])
    plain = protocol.encode("ack", {}, secret=SECRET, job=JOB, sender="x")
    assert "fd" not in json.loads(plain[0])
    # Frames arrive as zero-copy buffers too.
    msg = protocol.decode([*frames[:2], *map(memoryview, data)], secret=SECRET, job=JOB)
    assert [bytes(f) for f in msg.frames] == data


def test_frame_digests_are_keyed_by_secret_and_id() -> None:
    data = [b"chunk" * 100]
    mine = protocol.frame_digests(SECRET, "ab12", data)
    assert protocol.frame_digests(SECRET, "ab12", data) == mine
    # Without the secret the digests cannot be computed; another id gives other digests, so
    # a frame matching one message's digest says nothing about another's.
    assert protocol.frame_digests(b"other" * 8, "ab12", data) != mine
    assert protocol.frame_digests(SECRET, "ab13", data) != mine


def test_tampered_data_frame_is_auth_error() -> None:
    data = [b"chunk-one", b"chunk-two"]
    frames = protocol.encode("snap_flush", {"rank": 3}, secret=SECRET, job=JOB, sender="x",
                             data=data)
    flipped = bytearray(frames[3])
    flipped[0] ^= 1
    shifted = [frames[0], frames[1], b"chunk-on", b"echunk-two"]  # the same bytes, re-cut
    swapped = [frames[0], frames[1], frames[3], frames[2]]
    other = protocol.encode("snap_flush", {"rank": 3}, secret=SECRET, job=JOB, sender="x",
                            data=[b"chunk-one", b"chunk-six"])
    spliced = [*frames[:3], other[3]]  # an authentic frame of another message
    for bad in ([*frames[:3], bytes(flipped)], shifted, swapped, spliced, frames[:3],
                [*frames, b"more"]):
        with pytest.raises(AuthError):
            protocol.decode(bad, secret=SECRET, job=JOB)
    # A header that names no digests cannot carry frames, even when signed.
    bare = sign(header("snap_flush", {"rank": 3}))
    with pytest.raises(AuthError, match="names no digests"):
        protocol.decode([*bare, b"chunk-one"], secret=SECRET, job=JOB)
    assert protocol.decode(bare, secret=SECRET, job=JOB).frames == ()
    # Digests made without the job's secret, under a header signed with it, do not pass.
    forged = header("snap_flush", {"rank": 3})
    forged["fd"] = protocol.frame_digests(b"guess" * 8, forged["id"], [b"evil"])
    with pytest.raises(AuthError, match="do not match"):
        protocol.decode([*sign(forged), b"evil"], secret=SECRET, job=JOB)


def test_data_frame_limits() -> None:
    frames = protocol.encode("snap_flush", {"rank": 3}, secret=SECRET, job=JOB, sender="x",
                             data=[b"x" * 100])
    with pytest.raises(ProtocolError, match="100 bytes"):
        protocol.decode(frames, secret=SECRET, job=JOB, max_frame_bytes=99)
    with pytest.raises(ProtocolError, match="data frames"):
        protocol.encode("ack", {}, secret=SECRET, job=JOB, sender="x",
                        data=[b""] * (protocol.MAX_DATA_FRAMES + 1))


def test_reply_id_must_be_hex() -> None:
    with pytest.raises(ProtocolError, match="re"):
        protocol.decode(sign(header(re="not hex")), secret=SECRET, job=JOB)


def test_the_fast_walk_defers_to_the_detailed_one() -> None:
    """Validation takes a fast walk on exact JSON types; what it cannot tell (a subclass of a
    JSON type, in a body being encoded) goes through the detailed walk, which decides."""

    class Seconds(float):
        pass

    body = {**HEARTBEAT, "workers": [{**WORKER, "progress_age_s": Seconds(0.5)}]}
    frames = protocol.encode("heartbeat", body, secret=SECRET, job=JOB, sender="x")
    assert protocol.decode(frames, secret=SECRET, job=JOB).body["workers"][0][
        "progress_age_s"] == 0.5
    with pytest.raises(ProtocolError, match=r"workers\[0\].progress_age_s is nan"):
        protocol.validate("heartbeat",
                          {**HEARTBEAT, "workers": [{**WORKER, "progress_age_s": Seconds("nan")}]})
    # bool is not an int, even though Python says so; nesting is capped at any depth.
    with pytest.raises(ProtocolError, match="pid must be int"):
        protocol.validate("hello", {"node_id": "n", "host": "h", "pid": True})
    deep: Any = 1
    for _ in range(protocol.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(ProtocolError, match="nests deeper"):
        protocol.validate("event", {"node_id": "n", "type": "t",
                                                      "data": {"x": deep}})
    shallow: Any = 1
    for _ in range(protocol.MAX_DEPTH - 2):
        shallow = [shallow]
    protocol.validate("event", {"node_id": "n", "type": "t",
                                                  "data": {"x": shallow}})
