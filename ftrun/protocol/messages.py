"""The control-plane messages: every kind, the schema of its body, and their validation.

Every kind's body has a schema in :data:`SCHEMAS`; unknown fields, wrong types, over-long
strings and lists, and numbers that are not finite (NaN, infinity, at any depth) are
rejected, naming the field. Adding a kind is one entry in :data:`SCHEMAS`. How messages
travel (signed, size-limited frames) is :mod:`ftrun.protocol.codec`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

from ftrun.errors import ProtocolError

MAX_STRING_CHARS = 64 * 1024
MAX_LIST_ITEMS = 4096
MAX_DEPTH = 16

_NONE = type(None)


@dataclass(frozen=True)
class ListOf:
    """A list field whose items are ``item``: a type, a tuple of types, or a nested schema."""

    item: Any


@dataclass(frozen=True)
class Message:
    """One authenticated, validated message.

    ``re`` is the id of the request a reply answers (None in a request); ``frames`` are the
    binary frames that travelled beside the JSON header, covered by the same MAC;
    ``session`` and ``counter`` are the sender's session and the message's number in it.
    """

    kind: str
    job: str
    sender: str
    ts: float
    id: str
    body: dict[str, Any]
    re: str | None = None
    frames: tuple[bytes | memoryview, ...] = ()
    session: str = ""
    counter: int = 0


# A field spec is (type or tuple of types or ListOf or nested schema dict, required).
FieldSpec = tuple[Union[type, tuple[type, ...], ListOf, dict[str, Any]], bool]
Schema = dict[str, FieldSpec]

WORKER_SCHEMA: Schema = {
    "local_rank": (int, True),
    "rank": (int, True),
    "pid": ((int, _NONE), True),  # null while the worker is not (yet) running
    "state": (str, True),
    "exitcode": ((int, _NONE), True),
    # The launcher's verdict on a running rank (ftrun.launcher.suspect); optional.
    "health": (str, False),
    "cause": ((str, _NONE), False),
    "reason": ((str, _NONE), False),
    "step": ((int, _NONE), False),
    "progress_age_s": ((float, _NONE), False),
    "step_interval_s": ((float, _NONE), False),
    "progress_limit_s": ((float, _NONE), False),
}

# The one table of message kinds. ``dict`` means "any JSON object" (still size-checked).
SCHEMAS: dict[str, Schema] = {
    "hello": {"node_id": (str, True), "host": (str, True), "pid": (int, True)},
    "heartbeat": {
        "node_id": (str, True),
        "host": (str, True),
        "pid": (int, True),
        "state": (str, True),
        "group_rank": ((int, _NONE), True),
        "group_world_size": ((int, _NONE), True),
        "restarts": (int, True),
        "max_restarts": (int, True),
        "workers": (ListOf(WORKER_SCHEMA), True),
        "last_error": ((str, _NONE), True),
        "extra": (dict, False),
        # Directives this launcher carried out (their ids), until the coordinator stops
        # sending them; where its probe service listens (ftrun.launcher.probe).
        "acked": (ListOf(str), False),
        "probe_addr": (str, False),
        # This full heartbeat's number (keep-alives name it: ftrun.coordinator.membership).
        "serial": (int, False),
    },
    # Launcher -> coordinator, instead of a heartbeat when nothing but its workers' step and
    # progress age changed since full heartbeat ``same``: the node is alive and as it was.
    "keepalive": {"node_id": (str, True), "same": (int, True), "acked": (ListOf(str), False)},
    "event": {"node_id": (str, True), "type": (str, True), "data": (dict, True)},
    "bye": {"node_id": (str, True), "state": (str, True), "exitcode": (int, True)},
    # ``nodes``: which nodes the reply lists (all | problems | none), ``match``: only those
    # whose node id or host contains it, from ``offset``, at most ``limit`` (one page: the
    # reply's ``page.next`` is the offset of the next one).
    "status_request": {"nodes": (str, False), "match": (str, False), "offset": (int, False),
                       "limit": (int, False)},
    "status_reply": {"doc": (dict, True)},
    "events_request": {"since": (int, False)},
    "events_reply": {"events": (ListOf(dict), True), "more": (bool, False)},
    "error": {"message": (str, True), "error": (str, False)},
    # ``detect``: in the reply to ``hello`` only, where the node's ranks report their
    # collectives ("" when the coordinator runs no detection).
    "ack": {"re": (str, False), "detect": (str, False)},
    # Snapshots. Store -> coordinator: a rank's shard of ``step`` is verified (``ok`` false:
    # it failed verification, so the step can never commit); the epoch
    # (one per restore, agreed by all ranks) starts from ``base_step``. Reply: commit_info.
    # The store's --persist-every/--persist-interval ride on snap_epoch: the coordinator
    # decides which committed steps every store writes (ftrun.coordinator.commits).
    "snap_epoch": {"node_id": (str, True), "epoch": (str, True), "base_step": (int, True),
                   "world_size": (int, True), "persist_every": (int, False),
                   "persist_interval_s": (float, False), "source": (str, False)},
    "snap_verified": {"node_id": (str, True), "epoch": (str, True), "rank": (int, True),
                      "step": (int, True), "nbytes": (int, True), "ok": (bool, False)},
    "commit_query": {"epoch": (str, True)},
    # A store asks for a persist target now: on a signal, or (final) when it stops.
    "persist_request": {"node_id": (str, True), "epoch": (str, True), "reason": (str, True),
                        "final": (bool, True)},
    # ``dead``: uncommitted steps that can never commit (ftrun.coordinator.commits);
    # ``targets``: the epoch's recent persist targets; ``final``: its final one; ``settling``:
    # the final target waits for a step some ranks verified already (ask again); ``durable``:
    # the newest step whose every shard has its replicas, while replication runs (a store
    # keeps that step's buffers until a newer one is durable).
    "commit_info": {"epoch": (str, True), "committed": (int, True), "known": (bool, True),
                    "targets": (ListOf(int), False), "final": ((int, _NONE), False),
                    "settling": (bool, False), "dead": (ListOf(int), False),
                    "durable": (int, False)},
    # ``persist``: this store writes to disk; ``final``: its last write is done (it stops);
    # ``target_done``: the newest persist target of ``epoch`` it is done with; ``writing``:
    # the target it is writing now.
    "store_report": {"node_id": (str, True), "bytes": (int, True), "segments": (int, True),
                     "persisted_step": ((int, _NONE), True), "ranks": (ListOf(int), True),
                     "persist": (bool, False), "final": (bool, False),
                     "epoch": ((str, _NONE), False), "target_done": (int, False),
                     "writing": ((int, _NONE), False), "skipped": (int, False),
                     "every": ((int, _NONE), False),
                     # With --replicas m > 1: where its replica receiver listens, and m (the
                     # coordinator answers with a replica_plan instead of an ack); what its
                     # sender did so far: steps sent to a peer, superseded, abandoned.
                     "replica_addr": (str, False), "replicas": (int, False),
                     "shard_addr": (str, False),
                     "replica_sent": (int, False), "replica_superseded": (int, False),
                     "replica_abandoned": (int, False), "replica_refused": (str, False)},
    # Rank <-> its node's store (ipc, same secret).
    # ``skipped``: snapshots this rank gave up so far; ``every``: its snapshot interval now;
    # ``base``: the step its epoch resumed from (a restarted store learns the epoch from it).
    "snap_staged": {"rank": (int, True), "buffer": (int, True), "step": (int, True),
                    "epoch": (str, True), "skipped": (int, False), "every": (int, False),
                    "base": (int, False)},
    "snap_done": {"rank": (int, True), "buffer": (int, True), "step": (int, True),
                  "ok": (bool, True), "committed": (int, True), "reason": (str, False)},
    "snap_claim": {"rank": (int, True), "buffer": (int, True), "epoch": (str, True),
                   "need_committed": (int, True), "base": (int, False)},
    # ``buffer``: write into this buffer instead of the one asked for (the rank's newest
    # shard is of a dead step; its older buffer holds the last committed one).
    "snap_claim_reply": {"ok": (bool, True), "committed": (int, True), "buffer": (int, False)},
    "snap_flush": {"rank": (int, True)},
    # ``source``: where the step came from ("memory", "memory, resharded from N ranks (from
    # node(s) ...)", "disk (DIR)", "none"), shown by `ftrun status`.
    "snap_restored": {"rank": (int, True), "epoch": (str, True), "step": (int, True),
                      "world_size": (int, True), "source": (str, False)},
    "store_persist": {"reason": (str, True)},
    # Anyone with the job secret -> a node's store: what it holds (ftrun.snapshot.catalog).
    # ``rank``: only that rank's shards; ``hashes``: with their chunk hashes; ``replicas``:
    # the replicas of other nodes' shards held here too (their ``origin`` is that node).
    "catalog_request": {"rank": (int, False), "hashes": (bool, False),
                        "replicas": (bool, False)},
    "catalog_reply": {"node_id": (str, True), "records": (ListOf(dict), True)},
    # Replicas (ftrun.snapshot.replica). Coordinator -> store, answering its store_report:
    # the peers that hold this node's replicas (placement over the live stores), and m.
    # ``off``: why no step can be durable now (one node: no peer).
    "replica_plan": {"replicas": (int, True), "members": (int, True), "off": ((str, _NONE), False),
                     "peers": (ListOf({"node_id": (str, True), "addr": (str, True)}), True)},
    # Sender store -> receiver store. replica_begin carries two binary frames: the shard's
    # manifest and its chunk hash table (xxh3-64, little-endian u64 each); ``have``: this
    # step is already verified there. replica_chunk carries one frame, chunk ``chunk`` of the
    # data region; its ack says whether it matched its hash (``reason`` names it if not).
    # replica_end: all chunks sent; answered replica_done once every chunk checked, or an
    # error naming the chunks refused or missing.
    "replica_begin": {"origin": (str, True), "epoch": (str, True), "rank": (int, True),
                      "step": (int, True), "data_len": (int, True), "chunk_size": (int, True),
                      "n_tensors": (int, True)},
    # ``refused``: no room for this replica here (the reason); nothing more is sent.
    "replica_ready": {"have": (bool, True), "refused": (str, False)},
    "replica_chunk": {"origin": (str, True), "rank": (int, True), "step": (int, True),
                      "chunk": (int, True)},
    "replica_ack": {"rank": (int, True), "step": (int, True), "chunk": (int, True),
                    "ok": (bool, True), "reason": (str, False)},
    "replica_end": {"origin": (str, True), "rank": (int, True), "step": (int, True)},
    "replica_done": {"rank": (int, True), "step": (int, True), "verified": (bool, True)},
    # Receiver store -> coordinator: it holds a verified replica of ``origin``'s shard of
    # ``rank`` at ``step`` (ftrun.coordinator.commits counts durable steps). Reply: ack.
    "replica_verified": {"node_id": (str, True), "origin": (str, True), "epoch": (str, True),
                         "rank": (int, True), "step": (int, True)},
    # Anyone with the job secret -> a node's shard service (ftrun.snapshot.shards): the
    # verified shards the node holds, its own ranks' and replicas (``origin``: the node whose
    # rank wrote it; ``world_size``: of the job that took it).
    "holdings_request": {},
    "holdings_reply": {"node_id": (str, True), "records": (ListOf(dict), True)},
    # One held shard's manifest and chunk hash table: two binary frames.
    "shard_meta_request": {"segment": (str, True), "step": (int, True), "epoch": (str, True)},
    "shard_meta": {"data_len": (int, True), "chunk_size": (int, True)},
    # Chunks ``first .. first + count - 1`` of a held shard's data region: one frame each.
    "shard_read_request": {"segment": (str, True), "step": (int, True), "epoch": (str, True),
                           "first": (int, True), "count": (int, True)},
    "shard_data": {"first": (int, True), "count": (int, True)},
    # Rank -> its node's store, and store -> coordinator: the shard services of the job's
    # live stores (node -> address), where a restore looks for shards.
    "stores_request": {},
    "stores_reply": {"stores": (ListOf({"node_id": (str, True), "addr": (str, True)}), True)},
    # Detection (ftrun.rank.collectives -> the coordinator's detect endpoint, analysed by
    # ftrun.coordinator.detect). One rank's collective counters, from torch's Flight Recorder
    # (pg_status), sampled every ``interval_s`` on the rank's own monotonic clock; every time
    # is a local duration, never a clock reading. ``seq``: this process's report number.
    # Per process group ``pg`` (torch's group name, the same on every member) of ``size``
    # ranks: ``enqueued``/``completed``: the last collective sequence numbers; ``waiting_s``:
    # how long op ``completed + 1`` has been enqueued and not completed (null: none pending);
    # ``op``/``bytes``: what that op is, when known; ``done``: ops completed since the last
    # report that took at least one interval, as [seq, duration_s] (the others took less).
    "coll_report": {
        "node_id": (str, True), "host": (str, True), "rank": (int, True),
        "world_size": (int, True), "restart": (int, True), "pid": (int, True),
        "backend": (str, True), "seq": (int, True), "interval_s": (float, True),
        # The rendezvous round the rank belongs to (MASTER_ADDR:MASTER_PORT, new each
        # round): sequence numbers restart with every new world.
        "world": (str, False),
        "groups": (ListOf({
            "pg": (str, True), "size": (int, True), "enqueued": (int, True),
            "completed": (int, True), "waiting_s": ((float, _NONE), True),
            "op": (str, False), "bytes": (int, False), "ranks": (ListOf(int), False),
            "done": (ListOf(list), False),
        }), True),
    },
    # Coordinator -> launcher, in reply to its heartbeats until the heartbeat acks them by
    # id: orders (``action`` restart | isolate | probe) with their ``data``.
    "directives": {"directives": (ListOf({"id": (str, True), "action": (str, True),
                                          "data": (dict, True)}), True)},
    # Launcher -> a peer launcher's probe service: ``size`` bytes in one data frame, echoed
    # back as a probe_ack (ftrun.launcher.probe).
    "probe": {"size": (int, True)},
    "probe_ack": {"size": (int, True)},
    # Launcher -> coordinator: what probing each peer measured for directive ``id``.
    "probe_result": {"node_id": (str, True), "host": (str, True), "id": (str, True),
                     "results": (ListOf({"peer": (str, True), "host": (str, True),
                                         "rtt_s": ((float, _NONE), True),
                                         "mb_s": ((float, _NONE), True),
                                         "error": (str, False)}), True)},
    # Fault injection (tests, drills): the store flips a byte of ``rank``'s newest verified
    # shard, as a bad DIMM would, and says which.
    "fault_corrupt": {"rank": (int, True)},
    "fault_reply": {"segment": (str, True), "step": (int, True), "offset": (int, True)},
}


def _type_names(types: Any) -> str:
    if isinstance(types, ListOf):
        return "list"
    if isinstance(types, dict):
        return "object"
    if not isinstance(types, tuple):
        types = (types,)
    names = {_NONE: "null", dict: "object", list: "list", str: "string", int: "int",
             float: "number", bool: "bool"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _is_instance(value: Any, types: Any) -> bool:
    if not isinstance(types, tuple):
        types = (types,)
    for t in types:
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if t is bool and isinstance(value, bool):
            return True
        if t not in (int, float, bool) and isinstance(value, t):
            return True
    return False


def _check_json_value(value: Any, where: str, depth: int = 0) -> None:
    """Caps on free-form JSON: depth, string length, list length (sizes are capped anyway),
    and finite numbers."""
    if depth > MAX_DEPTH:
        raise ProtocolError(f"{where} nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        if len(value) > MAX_STRING_CHARS:
            raise ProtocolError(
                f"{where} is a string of {len(value)} chars (max {MAX_STRING_CHARS})"
            )
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ProtocolError(f"{where} is {value!r}: numbers must be finite")
    elif isinstance(value, list):
        if len(value) > MAX_LIST_ITEMS:
            raise ProtocolError(f"{where} is a list of {len(value)} items (max {MAX_LIST_ITEMS})")
        for i, item in enumerate(value):
            _check_json_value(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, dict):
        if len(value) > MAX_LIST_ITEMS:
            raise ProtocolError(f"{where} has {len(value)} keys (max {MAX_LIST_ITEMS})")
        for key, item in value.items():
            if not isinstance(key, str):
                raise ProtocolError(f"{where} has a non-string key {key!r}")
            _check_json_value(key, f"{where} key", depth + 1)
            _check_json_value(item, f"{where}.{key}", depth + 1)
    elif value is None or isinstance(value, (bool, int)):
        return
    else:
        raise ProtocolError(f"{where} holds a {type(value).__name__}, which is not JSON")


def _check_value(value: Any, spec: Any, where: str, depth: int) -> None:
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where} must be an object, got {type(value).__name__}")
        _validate(spec, value, where, depth + 1)
        return
    if isinstance(spec, ListOf):
        if not isinstance(value, list):
            raise ProtocolError(f"{where} must be a list, got {type(value).__name__}")
        if len(value) > MAX_LIST_ITEMS:
            raise ProtocolError(f"{where} is a list of {len(value)} items (max {MAX_LIST_ITEMS})")
        for i, item in enumerate(value):
            _check_value(item, spec.item, f"{where}[{i}]", depth + 1)
        return
    if not _is_instance(value, spec):
        raise ProtocolError(
            f"{where} must be {_type_names(spec)}, got {type(value).__name__} {_short(value)}"
        )
    _check_json_value(value, where, depth)


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the fast walk ------------------------------------------------------------------------------
# Each schema compiles once into predicates on exact JSON types that build no field names. They
# may say False for a valid value (a subclass of a JSON type, in a body being encoded), never
# True for an invalid one: False sends the value through the detailed walk, which decides.

_Check = Callable[[Any, int], bool]
_COMPILED: dict[int, tuple[Any, Callable[[Mapping[str, Any], int], bool]]] = {}


def _json_ok(value: Any, depth: int) -> bool:
    t = type(value)
    if t is str:
        return len(value) <= MAX_STRING_CHARS
    if t is float:
        return math.isfinite(value)
    if t is int or t is bool or value is None:
        return depth <= MAX_DEPTH
    if depth >= MAX_DEPTH:
        return False
    if t is list:
        return len(value) <= MAX_LIST_ITEMS and all(_json_ok(v, depth + 1) for v in value)
    if t is dict:
        return len(value) <= MAX_LIST_ITEMS and all(
            type(k) is str and len(k) <= MAX_STRING_CHARS and _json_ok(v, depth + 1)
            for k, v in value.items())
    return False


def _compile_value(spec: Any) -> _Check:
    if isinstance(spec, dict):
        sub = _compiled(spec)
        return lambda v, d: type(v) is dict and sub(v, d + 1)
    if isinstance(spec, ListOf):
        item = _compile_value(spec.item)
        return lambda v, d: (type(v) is list and len(v) <= MAX_LIST_ITEMS
                             and all(item(x, d + 1) for x in v))
    types = spec if isinstance(spec, tuple) else (spec,)
    exact = {int, float} if float in types else set()
    exact.update(types)
    if exact <= {int, bool, _NONE}:
        return lambda v, d: type(v) in exact
    if exact <= {int, float, bool, _NONE}:
        return lambda v, d: type(v) in exact and (type(v) is not float or math.isfinite(v))
    if exact <= {str, _NONE}:
        return lambda v, d: type(v) in exact and (v is None or len(v) <= MAX_STRING_CHARS)
    return lambda v, d: type(v) in exact and _json_ok(v, d)


def _compiled(schema: Mapping[str, FieldSpec]) -> Callable[[Mapping[str, Any], int], bool]:
    hit = _COMPILED.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    fields = [(name, required, _compile_value(spec)) for name, (spec, required) in schema.items()]

    def ok(obj: Mapping[str, Any], depth: int) -> bool:
        if depth > MAX_DEPTH:
            return False
        n = 0
        for name, required, check in fields:
            if name in obj:
                n += 1
                if not check(obj[name], depth):
                    return False
            elif required:
                return False
        return n == len(obj)  # no unknown fields

    if len(_COMPILED) >= 4096:  # schemas are static; this bounds one built per call
        _COMPILED.clear()
    _COMPILED[id(schema)] = (schema, ok)
    return ok


def validate(schema: Mapping[str, FieldSpec], obj: Mapping[str, Any], where: str = "body",
             depth: int = 0) -> None:
    """Check ``obj`` against ``schema``: no unknown fields, required ones present, types right,
    numbers finite; the error names the field. A valid message takes one walk that builds no
    field names (the receiving end's cost per message); an invalid one a second walk that
    names what is wrong."""
    if _compiled(schema)(obj, depth):
        return
    _validate(schema, obj, where, depth)


def _validate(schema: Mapping[str, FieldSpec], obj: Mapping[str, Any], where: str,
              depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ProtocolError(f"{where} nests deeper than {MAX_DEPTH} levels")
    unknown = sorted(set(obj) - set(schema))
    if unknown:
        raise ProtocolError(f"{where} has unknown field(s) {', '.join(map(repr, unknown))}")
    for name, (spec, required) in schema.items():
        if name not in obj:
            if required:
                raise ProtocolError(f"{where} lacks required field {name!r}")
            continue
        _check_value(obj[name], spec, f"{where}.{name}", depth)
