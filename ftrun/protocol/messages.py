"""The control-plane messages: every kind as a typed structure, declared once, with the kinds
that answer it.

Each kind's body is a :class:`Body` subclass (a ``msgspec.Struct``): its ``KIND`` is the
wire name, ``REPLIES`` the kinds its receiver may answer with (empty: none, or answered
only with an ``error``). :data:`BODIES` maps each kind to its structure. Decoding and
validation are one step (:func:`decoder`): unknown fields, wrong types, over-long strings and
lists, and numbers that are not finite (NaN, infinity, at any depth) are rejected. Optional
fields are :data:`UNSET` when absent, so a structure encodes back to exactly the object that
came. When a message is refused, :func:`explain` walks it once more to name the field and
what is wrong with it (the cold path only). How messages travel (signed, size-limited
frames) is :mod:`ftrun.protocol.codec`.

Adding a kind is one class here.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, TypeVar, Union

import msgspec
import msgspec.inspect as mi
from msgspec import UNSET, UnsetType

from ftrun._enum import StrEnum
from ftrun.errors import ProtocolError

MAX_STRING_CHARS = 64 * 1024
MAX_LIST_ITEMS = 4096
MAX_DEPTH = 16

__all__ = ["BODIES", "MAX_DEPTH", "MAX_LIST_ITEMS", "MAX_STRING_CHARS", "UNSET", "Body",
           "Message", "ReplyKind", "UnsetType", "decoder", "explain", "given", "to_dict",
           "validate"]

T = TypeVar("T")


class ReplyKind(StrEnum):
    """Kinds that only ever answer a request (their values are the wire names)."""

    ACK = "ack"
    ERROR = "error"
    DIRECTIVES = "directives"
    STATUS_REPLY = "status_reply"
    EVENTS_REPLY = "events_reply"
    COMMIT_INFO = "commit_info"
    REPLICA_PLAN = "replica_plan"
    SNAP_CLAIM_REPLY = "snap_claim_reply"
    CATALOG_REPLY = "catalog_reply"
    REPLICA_READY = "replica_ready"
    REPLICA_ACK = "replica_ack"
    REPLICA_DONE = "replica_done"
    HOLDINGS_REPLY = "holdings_reply"
    SHARD_META = "shard_meta"
    SHARD_DATA = "shard_data"
    STORES_REPLY = "stores_reply"
    PROBE_ACK = "probe_ack"
    FAULT_REPLY = "fault_reply"
    AGGREGATE_REPLY = "aggregate_reply"
    SURVEY_REPLY = "survey_reply"

    def __str__(self) -> str:
        return str(self.value)


def given(value: T | UnsetType, default: T) -> T:
    """An optional field's value, or ``default`` when it was absent."""
    return default if value is UNSET else value  # type: ignore[return-value]


class Message(msgspec.Struct, frozen=True):
    """One authenticated, validated message (built once per message: a frozen Struct, ten
    times cheaper to make than a frozen dataclass).

    ``body`` is the kind's :class:`Body` where the receiving end asked for typed messages,
    else the plain JSON object. ``re`` is the id of the request a reply answers (None in a
    request); ``frames`` are the binary frames that travelled beside the JSON header, covered
    by the same MAC; ``session`` and ``counter`` are the sender's session and the message's
    number in it. ``term`` is the coordinator term the message was signed for (0: none; see
    :mod:`ftrun.protocol.codec`).
    """

    kind: str
    job: str
    sender: str
    ts: float
    id: str
    body: Any
    re: str | None = None
    frames: tuple[bytes | memoryview, ...] = ()
    session: str = ""
    counter: int = 0
    term: int = 0


# -- field types ---------------------------------------------------------------------------------

_FMAX = 1.7976931348623157e308
Str = Annotated[str, msgspec.Meta(max_length=MAX_STRING_CHARS)]
Float = Annotated[float, msgspec.Meta(ge=-_FMAX, le=_FMAX)]  # finite (NaN fails both)
# Free-form JSON (checked for depth, string length and finite numbers after decoding).
Json = dict[str, Any]
L = Annotated  # a list of at most MAX_LIST_ITEMS items: L[list[X], Items]
Items = msgspec.Meta(max_length=MAX_LIST_ITEMS)
# Skipped snapshots by reason (a short key: store_busy, no_buffer, no_forward).
SkipReasons = Annotated[dict[Annotated[str, msgspec.Meta(max_length=32)], int],
                        msgspec.Meta(max_length=16)]


class Body(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """A message body. Subclasses set ``KIND`` (the wire name) and ``REPLIES``."""

    KIND: ClassVar[str] = ""
    REPLIES: ClassVar[tuple[str, ...]] = ()
    # The fields holding free-form JSON (set for each subclass below).
    _FREE: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name in self._FREE:
            value = getattr(self, name)
            if value is not UNSET and not _json_ok(value, 1):
                raise ValueError(f"free-form field {name!r} is out of bounds")


class Item(Body):
    """A nested object of a body (no kind of its own)."""


# -- the kinds -----------------------------------------------------------------------------------


class Worker(Item):
    local_rank: int
    rank: int
    pid: int | None  # null while the worker is not (yet) running
    state: Str
    exitcode: int | None
    # The launcher's verdict on a running rank (ftrun.launcher.suspect).
    health: Str | UnsetType = UNSET
    cause: Str | None | UnsetType = UNSET
    reason: Str | None | UnsetType = UNSET
    step: int | None | UnsetType = UNSET
    progress_age_s: Float | None | UnsetType = UNSET
    step_interval_s: Float | None | UnsetType = UNSET
    progress_limit_s: Float | None | UnsetType = UNSET


class Hello(Body):
    KIND = "hello"
    REPLIES = ("ack",)
    node_id: Str
    host: Str
    pid: int


class Heartbeat(Body):
    KIND = "heartbeat"
    REPLIES = ("directives",)  # or none
    node_id: Str
    host: Str
    pid: int
    state: Str
    group_rank: int | None
    group_world_size: int | None
    restarts: int
    max_restarts: int
    workers: L[list[Worker], Items]
    last_error: Str | None
    extra: Json | UnsetType = UNSET
    # Directives this launcher carried out (their ids), until the coordinator stops sending
    # them; where its probe service listens (ftrun.launcher.probe).
    acked: L[list[Str], Items] | UnsetType = UNSET
    probe_addr: Str | UnsetType = UNSET
    # This full heartbeat's number (keep-alives name it: ftrun.coordinator.membership).
    serial: int | UnsetType = UNSET
    # The aggregation plan this launcher follows (ftrun.coordinator.aggregation), and where
    # it takes its group's reports when it is the group's aggregator.
    plan: int | UnsetType = UNSET
    aggr_addr: Str | UnsetType = UNSET


class Keepalive(Body):
    """Launcher -> coordinator, instead of a heartbeat when nothing but its workers' step
    and progress age changed since full heartbeat ``same``: the node is alive and as it was."""

    KIND = "keepalive"
    REPLIES = ("directives",)  # or none
    node_id: Str
    same: int
    acked: L[list[Str], Items] | UnsetType = UNSET
    plan: int | UnsetType = UNSET


class Aggregate(Body):
    """A group's aggregator (a launcher the coordinator named) -> coordinator, once per
    heartbeat interval: the heartbeats and keep-alives its group's launchers (itself
    included) sent it since the last one, each as its launcher sent it (ftrun.coordinator.
    aggregation). The reply lists the directives of each member that has any."""

    KIND = "aggregate"
    REPLIES = ("aggregate_reply",)
    node_id: Str
    heartbeats: L[list[Heartbeat], Items]
    keepalives: L[list[Keepalive], Items]


class Event(Body):
    KIND = "event"
    node_id: Str
    type: Str
    data: Json


class Bye(Body):
    KIND = "bye"
    REPLIES = ("ack",)
    node_id: Str
    state: Str
    exitcode: int


class StatusRequest(Body):
    """``nodes``: which nodes the reply lists (all | problems | none), ``match``: only those
    whose node id or host contains it, from ``offset``, at most ``limit`` (one page: the
    reply's ``page.next`` is the offset of the next one)."""

    KIND = "status_request"
    REPLIES = ("status_reply",)
    nodes: Str | UnsetType = UNSET
    match: Str | UnsetType = UNSET
    offset: int | UnsetType = UNSET
    limit: int | UnsetType = UNSET


class StatusReply(Body):
    KIND = "status_reply"
    doc: Json


class EventsRequest(Body):
    KIND = "events_request"
    REPLIES = ("events_reply",)
    since: int | UnsetType = UNSET


class EventsReply(Body):
    KIND = "events_reply"
    events: L[list[Json], Items]
    more: bool | UnsetType = UNSET


class Error(Body):
    KIND = "error"
    message: Str
    error: Str | UnsetType = UNSET


class Ack(Body):
    """In the reply to ``hello`` only: ``detect``, where the node's ranks report their
    collectives ("" when the coordinator runs no detection), and ``on_hang``/``on_slow``,
    the detection policy the coordinator acts on for the whole job (a launcher whose own
    flags differ says so)."""

    KIND = "ack"
    re: Str | UnsetType = UNSET
    detect: Str | UnsetType = UNSET
    on_hang: Str | UnsetType = UNSET
    on_slow: Str | UnsetType = UNSET
    on_corruption: Str | UnsetType = UNSET


# Snapshots. Store -> coordinator: a rank's shard of ``step`` is verified (``ok`` false: it
# failed verification, so the step can never commit); the epoch (one per restore, agreed by
# all ranks) starts from ``base_step``. Reply: commit_info. The store's
# --persist-every/--persist-interval ride on snap_epoch: the coordinator decides which
# committed steps every store writes (ftrun.coordinator.commits).
class SnapEpoch(Body):
    KIND = "snap_epoch"
    REPLIES = ("commit_info",)
    node_id: Str
    epoch: Str
    base_step: int
    world_size: int
    persist_every: int | UnsetType = UNSET
    persist_interval_s: Float | UnsetType = UNSET
    source: Str | UnsetType = UNSET
    # Taught again to a coordinator that did not know it (restarted, or a failover), not a
    # restore: base_step is then the newest step the store knows committed.
    retaught: bool | UnsetType = UNSET


class ReplicaDigest(Item):
    """The digest of a shard's replicated tensors (ftrun.snapshot.replicas): compared across
    the replica ``group`` by the coordinator (ftrun.coordinator.corruption)."""

    group: Str
    digest: Str
    parts: L[list[Str], Items]
    names: L[list[list[Str | int]], Items] | UnsetType = UNSET  # the group's lead sends them


class SnapVerified(Body):
    KIND = "snap_verified"
    REPLIES = ("commit_info",)
    node_id: Str
    epoch: Str
    rank: int
    step: int
    nbytes: int
    ok: bool | UnsetType = UNSET
    replicas: L[list[ReplicaDigest], Items] | UnsetType = UNSET


class CommitQuery(Body):
    KIND = "commit_query"
    REPLIES = ("commit_info",)
    epoch: Str


class PersistRequest(Body):
    """A store asks for a persist target now: on a signal, or (final) when it stops."""

    KIND = "persist_request"
    REPLIES = ("commit_info",)
    node_id: Str
    epoch: Str
    reason: Str
    final: bool


class CommitInfo(Body):
    """``dead``: uncommitted steps that can never commit (ftrun.coordinator.commits);
    ``targets``: the epoch's recent persist targets; ``final``: its final one; ``settling``:
    the final target waits for a step some ranks verified already (ask again); ``durable``:
    the newest step whose every shard has its replicas, while replication runs (a store
    keeps that step's buffers until a newer one is durable)."""

    KIND = "commit_info"
    epoch: Str
    committed: int
    known: bool
    targets: L[list[int], Items] | UnsetType = UNSET
    final: int | None | UnsetType = UNSET
    settling: bool | UnsetType = UNSET
    dead: L[list[int], Items] | UnsetType = UNSET
    durable: int | UnsetType = UNSET
    disagreed: L[list[int], Items] | UnsetType = UNSET  # dead: the replicas differ


class StoreReport(Body):
    """``persist``: this store writes to disk; ``final``: its last write is done (it stops);
    ``target_done``: the newest persist target of ``epoch`` it is done with; ``writing``: the
    target it is writing now. With --replicas m > 1: where its replica receiver listens, and
    m (the coordinator answers with a replica_plan instead of an ack); what its sender did so
    far: steps sent to a peer, superseded, abandoned."""

    KIND = "store_report"
    REPLIES = ("ack", "replica_plan")
    node_id: Str
    bytes: int
    segments: int
    persisted_step: int | None
    ranks: L[list[int], Items]
    persist: bool | UnsetType = UNSET
    final: bool | UnsetType = UNSET
    epoch: Str | None | UnsetType = UNSET
    target_done: int | UnsetType = UNSET
    writing: int | None | UnsetType = UNSET
    skipped: int | UnsetType = UNSET
    every: int | None | UnsetType = UNSET
    blocked_s: Float | UnsetType = UNSET  # the most any of its ranks was held by snapshots
    skip_reasons: SkipReasons | UnsetType = UNSET  # its ranks' skips over the job, by reason
    replica_addr: Str | UnsetType = UNSET
    replicas: int | UnsetType = UNSET
    shard_addr: Str | UnsetType = UNSET
    replica_sent: int | UnsetType = UNSET
    replica_superseded: int | UnsetType = UNSET
    replica_abandoned: int | UnsetType = UNSET
    replica_refused: Str | UnsetType = UNSET
    # --redundancy ec:K+M (ftrun.store.ec_store): the code, the newest step whose parity this
    # store built, the newest step whose parity the whole placement holds (durable), and the
    # bytes its parity fragments and rebuilt shards take
    redundancy: Str | UnsetType = UNSET
    parity_step: int | UnsetType = UNSET
    parity_durable: int | UnsetType = UNSET
    parity_bytes: int | UnsetType = UNSET
    rebuilt_bytes: int | UnsetType = UNSET


# Rank <-> its node's store (ipc, same secret).
class SnapStaged(Body):
    """``skipped``: snapshots this rank gave up so far; ``every``: its snapshot interval now;
    ``base``: the step its epoch resumed from (a restarted store learns the epoch from it);
    ``blocked_s``: how long its snapshots held its training thread so far; ``skip_reasons``:
    the snapshots it gave up so far, by reason; ``counts``: the identity of the Snapshotter
    those running totals belong to (a new one starts them from zero)."""

    KIND = "snap_staged"
    REPLIES = ("snap_done",)
    rank: int
    buffer: int
    step: int
    epoch: Str
    skipped: int | UnsetType = UNSET
    every: int | UnsetType = UNSET
    base: int | UnsetType = UNSET
    blocked_s: Float | UnsetType = UNSET
    skip_reasons: SkipReasons | UnsetType = UNSET
    counts: Str | UnsetType = UNSET


class SnapDone(Body):
    KIND = "snap_done"
    rank: int
    buffer: int
    step: int
    ok: bool
    committed: int
    reason: Str | UnsetType = UNSET


class SnapClaim(Body):
    KIND = "snap_claim"
    REPLIES = ("snap_claim_reply",)
    rank: int
    buffer: int
    epoch: Str
    need_committed: int
    base: int | UnsetType = UNSET


class SnapClaimReply(Body):
    """``buffer``: write into this buffer instead of the one asked for (the rank's newest
    shard is of a dead step; its older buffer holds the last committed one)."""

    KIND = "snap_claim_reply"
    ok: bool
    committed: int
    buffer: int | UnsetType = UNSET


class SnapFlush(Body):
    KIND = "snap_flush"
    REPLIES = ("ack",)
    rank: int


class SnapRestored(Body):
    """``source``: where the step came from ("memory", "memory, resharded from N ranks (from
    node(s) ...)", "disk (DIR)", "none"), shown by `ftrun status`."""

    KIND = "snap_restored"
    REPLIES = ("ack",)
    rank: int
    epoch: Str
    step: int
    world_size: int
    source: Str | UnsetType = UNSET


class StorePersist(Body):
    KIND = "store_persist"
    REPLIES = ("ack",)
    reason: Str


class CatalogRequest(Body):
    """Anyone with the job secret -> a node's store: what it holds (ftrun.store.catalog).
    ``rank``: only that rank's shards; ``hashes``: with their chunk hashes; ``replicas``:
    the replicas of other nodes' shards held here too (their ``origin`` is that node)."""

    KIND = "catalog_request"
    REPLIES = ("catalog_reply",)
    rank: int | UnsetType = UNSET
    hashes: bool | UnsetType = UNSET
    replicas: bool | UnsetType = UNSET


class CatalogReply(Body):
    """``committed`` and ``durable``: the newest steps the store knows committed and durable
    (-1: none yet); ``replicating``: its replication runs. A restore that finds nothing to
    resume from compares with them (ftrun.rank.restore)."""

    KIND = "catalog_reply"
    node_id: Str
    records: L[list[Json], Items]
    committed: int | UnsetType = UNSET
    durable: int | UnsetType = UNSET
    replicating: bool | UnsetType = UNSET


class Peer(Item):
    node_id: Str
    addr: Str


class ReplicaPlan(Body):
    """Coordinator -> store, answering its store_report: the peers that hold this node's
    replicas (placement over the live stores), and m. ``off``: why no step can be durable
    now (one node: no peer)."""

    KIND = "replica_plan"
    replicas: int
    members: int
    peers: L[list[Peer], Items]
    off: Str | None | UnsetType = UNSET


# Sender store -> receiver store (ftrun.store.replica). replica_begin carries two binary
# frames: the shard's manifest and its chunk hash table (xxh3-64, little-endian u64 each).
# replica_chunk carries one frame, chunk ``chunk`` of the data region; its ack says whether
# it matched its hash (``reason`` names it if not). replica_end: all chunks sent; answered
# replica_done once every chunk checked, or an error naming the chunks refused or missing.
class ReplicaBegin(Body):
    KIND = "replica_begin"
    REPLIES = ("replica_ready",)
    origin: Str
    epoch: Str
    rank: int
    step: int
    data_len: int
    chunk_size: int
    n_tensors: int


class ReplicaReady(Body):
    """``have``: this step is already verified there; ``refused``: no room for this replica
    here (the reason); nothing more is sent."""

    KIND = "replica_ready"
    have: bool
    refused: Str | UnsetType = UNSET


class ReplicaChunk(Body):
    KIND = "replica_chunk"
    REPLIES = ("replica_ack",)
    origin: Str
    rank: int
    step: int
    chunk: int


class ReplicaAck(Body):
    KIND = "replica_ack"
    rank: int
    step: int
    chunk: int
    ok: bool
    reason: Str | UnsetType = UNSET


class ReplicaEnd(Body):
    KIND = "replica_end"
    REPLIES = ("replica_done",)
    origin: Str
    rank: int
    step: int


class ReplicaDone(Body):
    KIND = "replica_done"
    rank: int
    step: int
    verified: bool


class ReplicaVerified(Body):
    """Receiver store -> coordinator: it holds a verified replica of ``origin``'s shard of
    ``rank`` at ``step`` (ftrun.coordinator.commits counts durable steps)."""

    KIND = "replica_verified"
    REPLIES = ("ack",)
    node_id: Str
    origin: Str
    epoch: Str
    rank: int
    step: int


class ReplicaDropped(Body):
    """Receiver store -> coordinator: it overwrote its verified replica of ``origin``'s shard
    of ``rank`` at ``step`` with a newer one; not counted towards that step's durability
    any more."""

    KIND = "replica_dropped"
    REPLIES = ("ack",)
    node_id: Str
    origin: Str
    epoch: Str
    rank: int
    step: int


class HoldingsRequest(Body):
    """Anyone with the job secret -> a node's shard service (ftrun.store.shards): the
    verified shards the node holds, its own ranks' and replicas (``origin``: the node whose
    rank wrote it; ``world_size``: of the job that took it)."""

    KIND = "holdings_request"
    REPLIES = ("holdings_reply",)


class HoldingsReply(Body):
    """``refused``: the lost nodes' shards this node was to rebuild and could not (erasure
    coding: ``origin``, ``step``, ``epoch``, ``why``), so that the stores waiting for them
    stop at once."""

    KIND = "holdings_reply"
    node_id: Str
    records: L[list[Json], Items]
    refused: L[list[Json], Items] | UnsetType = UNSET


class SurveyRequest(Body):
    """Rank -> its node's store: every verified shard the job's live stores hold, from one
    survey per node and restore (``key`` names the restore: the ranks of a node that restore
    together send the same), ``offset`` onwards (ftrun.store.survey)."""

    KIND = "survey_request"
    REPLIES = ("survey_reply",)
    key: Str
    offset: int | UnsetType = UNSET


class SurveyReply(Body):
    """``ready`` false: the survey is under way, ask again. ``records``: holdings as
    ``holdings_reply`` lists them, with the ``node`` and ``addr`` of the store that holds
    each; ``lost``: the stores that did not answer; ``next``: the offset of the next page
    (absent at the end)."""

    KIND = "survey_reply"
    ready: bool
    records: L[list[Json], Items] | UnsetType = UNSET
    lost: L[list[Str], Items] | UnsetType = UNSET
    next: int | UnsetType = UNSET


class ShardMetaRequest(Body):
    """One held shard's manifest and chunk hash table: two binary frames."""

    KIND = "shard_meta_request"
    REPLIES = ("shard_meta",)
    segment: Str
    step: int
    epoch: Str


class ShardMeta(Body):
    KIND = "shard_meta"
    data_len: int
    chunk_size: int


class ShardReadRequest(Body):
    """Chunks ``first .. first + count - 1`` of a held shard's data region: one frame each."""

    KIND = "shard_read_request"
    REPLIES = ("shard_data",)
    segment: Str
    step: int
    epoch: Str
    first: int
    count: int


class ShardData(Body):
    KIND = "shard_data"
    first: int
    count: int


class StoresRequest(Body):
    """Rank -> its node's store, and store -> coordinator: the shard services of the job's
    live stores (node -> address), where a restore looks for shards."""

    KIND = "stores_request"
    REPLIES = ("stores_reply",)


class StoresReply(Body):
    KIND = "stores_reply"
    stores: L[list[Peer], Items]


class CoordinatorMoved(Body):
    """Launcher -> its node's store: the job's coordinator failed over (``--rdzv-backend
    etcd``); report to ``endpoint`` under ``term`` from now on, and teach it everything."""

    KIND = "coordinator_moved"
    REPLIES = ("ack",)
    endpoint: Str
    term: Annotated[int, msgspec.Meta(ge=1)]


class CollGroup(Item):
    pg: Str
    size: int
    enqueued: int
    completed: int
    waiting_s: Float | None
    op: Str | UnsetType = UNSET
    bytes: int | UnsetType = UNSET
    ranks: L[list[int], Items] | UnsetType = UNSET
    done: L[list[list[Any]], Items] | UnsetType = UNSET


class CollReport(Body):
    """Detection (ftrun.rank.collectives -> the coordinator's detect endpoint, analysed by
    ftrun.coordinator.detect). One rank's collective counters, from torch's Flight Recorder
    (pg_status), sampled every ``interval_s`` on the rank's own monotonic clock; every time
    is a local duration, never a clock reading. ``seq``: this process's report number. Per
    process group ``pg`` (torch's group name, the same on every member) of ``size`` ranks:
    ``enqueued``/``completed``: the last collective sequence numbers; ``waiting_s``: how long
    op ``completed + 1`` has been enqueued and not completed (null: none pending);
    ``op``/``bytes``: what that op is, when known; ``done``: ops completed since the last
    report that took at least one interval, as [seq, duration_s] (the others took less).
    ``world``: the rendezvous round the rank belongs to (MASTER_ADDR:MASTER_PORT, new each
    round): sequence numbers restart with every new world."""

    KIND = "coll_report"
    node_id: Str
    host: Str
    rank: int
    world_size: int
    restart: int
    pid: int
    backend: Str
    seq: int
    interval_s: Float
    groups: L[list[CollGroup], Items]
    world: Str | UnsetType = UNSET
    # The rank's last report: it stops reporting because it leaves (its process exits, or its
    # training function returned or raised), not because it hangs.
    leaving: bool | UnsetType = UNSET
    # How long the process has been idle (under a tenth of a core, next to no I/O: see
    # ftrun.rank.collectives.Activity), as of this report; absent while it is busy. A rank
    # outside any collective that is idle while its peers wait for it is hung.
    idle_s: Annotated[float, msgspec.Meta(ge=0, le=_FMAX)] | UnsetType = UNSET


class CollClass(Item):
    """Ranks of one process group in the same state, counted together (a ``coll_summary``):
    the same last sequence numbers ``enqueued``/``completed``. ``ranks``: the lowest
    :data:`ftrun.coordinator.collsum.CLASS_RANKS` of the ``count``; ``waiting_min_s``/
    ``waiting_max_s``: the shortest and longest wait of those waiting (null: none waits),
    as of the summary; ``waiting``: how many wait; ``op``: the pending op, when known;
    ``elsewhere``: listed ranks waiting in another group, as [rank, pg, seq, waiting_s]."""

    enqueued: int
    completed: int
    count: Annotated[int, msgspec.Meta(ge=1)]
    ranks: L[list[int], Items]
    waiting: int = 0
    waiting_min_s: Float | None = None
    waiting_max_s: Float | None = None
    op: Str | UnsetType = UNSET
    elsewhere: L[list[tuple[int, Str, int, Float]], Items] | UnsetType = UNSET


class CollGroupSummary(Item):
    """One process group in a ``coll_summary``: its ``size``, how many of its ranks the
    summary covers (``members``), their classes, and the longest duration of each op that
    took at least one interval on some rank, as [seq, seconds] (``ops``)."""

    pg: Str
    size: int
    members: int
    classes: L[list[CollClass], Items]
    ops: L[list[list[Any]], Items] | UnsetType = UNSET


class CollSummary(Body):
    """Detection at scale (ftrun.coordinator.collsum): the ranks' ``coll_report``s of one
    launcher, or of a group of launchers, reduced on the way to the coordinator's detect
    endpoint. ``node_id``: the sender; ``nodes``: the launchers whose ranks it covers;
    ``world``/``restart``/``interval_s`` as in ``coll_report``; ``seq``: the sender's summary
    number. ``roster``: every covered rank as [rank, node_id, host] (sent when it changed and
    every few summaries); ``silent``: covered ranks that have not reported for a while, as
    [rank, seconds]; ``left``: covered ranks whose last report said they leave."""

    KIND = "coll_summary"
    node_id: Str
    nodes: L[list[Str], Items]
    restart: int
    interval_s: Float
    seq: int
    groups: L[list[CollGroupSummary], Items]
    world: Str | UnsetType = UNSET
    roster: L[list[tuple[int, Str, Str]], Items] | UnsetType = UNSET
    silent: L[list[tuple[int, Float]], Items] | UnsetType = UNSET
    left: L[list[int], Items] | UnsetType = UNSET


class Directive(Item):
    id: Str
    action: Str
    data: Json


class Directives(Body):
    """Coordinator -> launcher, in reply to its heartbeats until the heartbeat acks them by
    id: orders (``action`` restart | isolate | probe | report) with their ``data``."""

    KIND = "directives"
    directives: L[list[Directive], Items]


class MemberDirectives(Item):
    node_id: Str
    directives: L[list[Directive], Items]


class AggregateReply(Body):
    """Coordinator -> aggregator: the directives of its members (those with any); the
    aggregator hands each member its own in the reply to the member's next report."""

    KIND = "aggregate_reply"
    members: L[list[MemberDirectives], Items]


class Probe(Body):
    """Launcher -> a peer launcher's probe service: ``size`` bytes in one data frame, echoed
    back as a probe_ack (ftrun.launcher.probe)."""

    KIND = "probe"
    REPLIES = ("probe_ack",)
    size: int


class ProbeAck(Body):
    KIND = "probe_ack"
    size: int


class ProbeOutcome(Item):
    peer: Str
    host: Str
    rtt_s: Float | None
    mb_s: Float | None
    error: Str | UnsetType = UNSET


class ProbeResult(Body):
    """Launcher -> coordinator: what probing each peer measured for directive ``id``."""

    KIND = "probe_result"
    REPLIES = ("ack",)
    node_id: Str
    host: Str
    id: Str
    results: L[list[ProbeOutcome], Items]


class FaultCorrupt(Body):
    """Fault injection (tests, drills): the store flips a byte of ``rank``'s newest verified
    shard, as a bad DIMM would, and says which."""

    KIND = "fault_corrupt"
    REPLIES = ("fault_reply",)
    rank: int


class FaultReply(Body):
    KIND = "fault_reply"
    segment: Str
    step: int
    offset: int


# In-process restart. Launcher -> one of its ranks, on the rank's control socket
# (ftrun.rank.resilient; FTRUN_RANK_CONTROL): leave the training function (``rank_abort``),
# run it again in this world (``rank_world``), or end with the error it raised
# (``rank_exit``). ``generation`` numbers the launcher's restarts in place; a rank ignores an
# order of a generation older than the one it runs.
RankEnv = Annotated[dict[Str, Str], msgspec.Meta(max_length=256)]


class RankAbort(Body):
    KIND = "rank_abort"
    REPLIES = ("ack",)
    generation: int
    reason: Str


class RankWorld(Body):
    """``env``: the variables a fresh worker of this world would start with (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...)."""

    KIND = "rank_world"
    REPLIES = ("ack",)
    generation: int
    env: RankEnv


class RankExit(Body):
    KIND = "rank_exit"
    REPLIES = ("ack",)
    generation: int
    reason: Str


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _free_fields(cls: type[Body]) -> tuple[str, ...]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return tuple(f.name for f in info.fields if _has_any(f.type))


def _has_any(t: mi.Type) -> bool:
    if isinstance(t, mi.AnyType):
        return True
    if isinstance(t, mi.UnionType):
        return any(_has_any(x) for x in t.types)
    if isinstance(t, mi.DictType):
        return _has_any(t.value_type)
    if isinstance(t, mi.ListType):
        return _has_any(t.item_type)
    return False


# The one table of message kinds: kind -> its body.
BODIES: dict[str, type[Body]] = {}
for _cls in _subclasses(Body):
    _cls._FREE = _free_fields(_cls)
    if _cls.KIND:
        assert _cls.KIND not in BODIES, _cls.KIND
        BODIES[_cls.KIND] = _cls
for _cls in BODIES.values():
    assert set(_cls.REPLIES) <= set(BODIES), (_cls.KIND, _cls.REPLIES)
assert {k.value for k in ReplyKind} <= set(BODIES)

_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    kind: msgspec.json.Decoder(cls) for kind, cls in BODIES.items()}


def decoder(kind: str) -> msgspec.json.Decoder[Any]:
    """The decoder of ``kind``'s body (KeyError for an unknown kind)."""
    return _DECODERS[kind]


def to_dict(body: Body) -> dict[str, Any]:
    """A body as the plain JSON object it travels as (absent fields absent)."""
    return msgspec.to_builtins(body)  # type: ignore[no-any-return]


def validate(body_type: Union[str, type[Body]], obj: Any, where: str = "body") -> None:
    """Check a plain object against a kind's body (by kind name or type): no unknown fields,
    required ones present, types right, numbers finite; the error names the field."""
    cls = BODIES[body_type] if isinstance(body_type, str) else body_type
    try:
        msgspec.convert(obj, cls)
    except msgspec.ValidationError as e:
        explain(obj, cls, where)
        del e  # the typed check refused a subclass of a JSON type that the walk accepts


# -- naming what is wrong (the cold path) --------------------------------------------------------


def explain(obj: Any, cls: type[Body], where: str) -> None:
    """Raise a ProtocolError naming the field of ``obj`` that ``cls`` refuses; return only
    where the walk finds nothing wrong (a subclass of a JSON type, in a body being encoded,
    which the typed check refuses and this accepts)."""
    _walk(obj, mi.type_info(cls), where, 0)


_NAMES = {mi.NoneType: "null", mi.DictType: "object", mi.ListType: "list", mi.TupleType: "list",
          mi.StrType: "string", mi.IntType: "int", mi.FloatType: "number", mi.BoolType: "bool"}


def _members(t: mi.Type) -> tuple[mi.Type, ...]:
    return t.types if isinstance(t, mi.UnionType) else (t,)


def _is(value: Any, t: mi.Type) -> bool:
    if isinstance(t, mi.IntType):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(t, mi.FloatType):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(t, mi.BoolType):
        return isinstance(value, bool)
    if isinstance(t, mi.StrType):
        return isinstance(value, str)
    if isinstance(t, mi.NoneType):
        return value is None
    if isinstance(t, (mi.DictType, mi.StructType)):
        return isinstance(value, dict)
    if isinstance(t, (mi.ListType, mi.TupleType)):
        return isinstance(value, (list, tuple))
    return isinstance(t, mi.AnyType)


def _walk(value: Any, t: mi.Type, where: str, depth: int) -> None:
    if isinstance(t, mi.StructType):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where} must be an object, got {type(value).__name__}")
        if depth > MAX_DEPTH:
            raise ProtocolError(f"{where} nests deeper than {MAX_DEPTH} levels")
        fields = {f.encode_name: f for f in t.fields}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise ProtocolError(f"{where} has unknown field(s) {', '.join(map(repr, unknown))}")
        for name, f in fields.items():
            if name not in value:
                if f.required:
                    raise ProtocolError(f"{where} lacks required field {name!r}")
                continue
            _walk(value[name], f.type, f"{where}.{name}", depth + 1)
        return
    if isinstance(t, mi.ListType) and not isinstance(t.item_type, mi.AnyType):
        if not isinstance(value, list):
            raise ProtocolError(f"{where} must be a list, got {type(value).__name__}")
        if len(value) > MAX_LIST_ITEMS:
            raise ProtocolError(f"{where} is a list of {len(value)} items (max {MAX_LIST_ITEMS})")
        for i, item in enumerate(value):
            _walk(item, t.item_type, f"{where}[{i}]", depth + 1)
        return
    if isinstance(t, mi.TupleType):  # a fixed shape: [rank, node, host] and the like
        if not isinstance(value, (list, tuple)) or len(value) != len(t.item_types):
            raise ProtocolError(f"{where} must be a list of {len(t.item_types)} items, got "
                                f"{_short(value)}")
        for i, (item, item_type) in enumerate(zip(value, t.item_types, strict=True)):
            _walk(item, item_type, f"{where}[{i}]", depth + 1)
        return
    members = _members(t)
    match = next((m for m in members if _is(value, m)), None)
    if match is None:
        names = " or ".join(_NAMES.get(type(m), "object") for m in members)
        raise ProtocolError(f"{where} must be {names}, got {type(value).__name__} "
                            f"{_short(value)}")
    if isinstance(match, (mi.StructType, mi.ListType, mi.TupleType)) and len(members) > 1:
        _walk(value, match, where, depth)
        return
    _check_json_value(value, where, depth)


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


def _json_ok(value: Any, depth: int) -> bool:
    """The free-form caps of :func:`_check_json_value`, as a fast yes/no on decoded JSON."""
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


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
