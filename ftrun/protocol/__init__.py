"""The control plane's protocol: typed messages (:mod:`.messages`), their signed wire format
(:mod:`.codec`), the request/reply transport over ZeroMQ (:mod:`.transport`) and the service
runtime every server runs on (:mod:`.service`); the last two are imported on their own (they
load ZeroMQ)."""

from ftrun.protocol.codec import (
    AUTH_REFUSED,
    MAC_BYTES,
    MAX_CLOCK_SKEW_S,
    MAX_DATA_FRAMES,
    MAX_FRAME_BYTES,
    MAX_MESSAGE_BYTES,
    VERSION,
    decode,
    encode,
    frame_digests,
    new_id,
    parse,
    verify,
)
from ftrun.protocol.endpoints import join_endpoint, split_endpoint, zmq_url
from ftrun.protocol.messages import (
    BODIES,
    MAX_DEPTH,
    MAX_LIST_ITEMS,
    MAX_STRING_CHARS,
    UNSET,
    Body,
    Message,
    ReplyKind,
    given,
    validate,
)

__all__ = [
    "AUTH_REFUSED", "BODIES", "MAC_BYTES", "MAX_CLOCK_SKEW_S", "MAX_DATA_FRAMES", "MAX_DEPTH",
    "MAX_FRAME_BYTES", "MAX_LIST_ITEMS", "MAX_MESSAGE_BYTES", "MAX_STRING_CHARS", "UNSET",
    "VERSION", "Body", "Message", "ReplyKind", "decode", "encode", "frame_digests", "given",
    "join_endpoint", "new_id", "parse", "split_endpoint", "validate", "verify", "zmq_url",
]
