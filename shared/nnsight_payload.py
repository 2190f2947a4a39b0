"""An nnsight payload's bytes, checked before anything loads them: nnsight's client may zstd-compress
its payload (CONFIG.API.COMPRESS, on by default), and nnsight's own loader decompresses the whole
frame into memory at the size its header declares. So the API reads that declared size at submit
and refuses a frame that does not declare one, declares more than ACTQ_NNSIGHT_MAX_REQUEST_BYTES, or
expands past MAX_RATIO; then it decompresses the first bytes only (never more) and checks they
start Python's object serialization at the protocol nnsight 0.8 writes (0x80, then 4). The
worker decompresses the stored payload itself under the same cap (worker/engine/nnsight_io.py) and
hands nnsight the result.

Nothing here loads the payload: it is code, loaded only by the worker (worker/nnsight/jobs.py).
"""

from __future__ import annotations

import io

import zstandard

from shared.errors import BadRequest, PayloadTooLarge

MAX_RATIO = 1000  # decompressed bytes per compressed byte; nnsight payloads compress 3-10x
PROTOCOLS = (4, 5)  # nnsight 0.8 serializes with protocol 4 (its serialization module's DEFAULT_PROTOCOL)
SETTING = "ACTQ_NNSIGHT_MAX_REQUEST_BYTES"
_CHUNK = 1 << 20


def declared_size(payload: bytes, limit: int) -> int:
    """The size a compressed payload's zstd frame declares, checked against `limit` and MAX_RATIO."""
    try:
        size = zstandard.get_frame_parameters(payload).content_size
    except zstandard.ZstdError:
        raise BadRequest(
            "the request says its payload is zstd-compressed (`compress`), but the `blob` does not start with a "
            "zstd frame: send the payload nnsight's client serialised"
        ) from None
    if size == zstandard.CONTENTSIZE_UNKNOWN:
        raise BadRequest(
            "the payload's zstd frame does not declare its decompressed size, which nnsight's client always writes "
            "(and nnsight's loader needs): compress it in one call, as nnsight's RequestModel.serialize does"
        )
    if size > limit:
        raise PayloadTooLarge(
            f"the payload decompresses to {size:,} bytes, over {limit:,} ({SETTING}, which bounds a payload "
            "decompressed too): save and send less, or load large inputs from storage inside the trace"
        )
    if size > MAX_RATIO * len(payload):
        raise PayloadTooLarge(
            f"the payload's {len(payload):,} compressed bytes declare {size:,} decompressed, over {MAX_RATIO}:1 "
            "(actq's bound on zstd payloads): send it uncompressed (nnsight's CONFIG.API.COMPRESS = False)"
        )
    return size


def decompress(payload: bytes, limit: int) -> bytes:
    """The payload's first zstd frame, decompressed as a stream that stops past `limit` bytes
    (PayloadTooLarge), whatever its header declares; BadRequest when it is not zstd."""
    declared_size(payload, limit)
    parts, total = [], 0
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(payload)) as reader:
            while part := reader.read(_CHUNK):
                total += len(part)
                if total > limit:
                    raise PayloadTooLarge(f"the payload decompresses to over {limit:,} bytes ({SETTING})")
                parts.append(part)
    except zstandard.ZstdError as exc:
        raise BadRequest(f"the payload is not valid zstd ({exc})") from None
    return b"".join(parts)


def _start(payload: bytes, compress: bool, size: int) -> bytes:
    if not compress:
        return payload[:size]
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(payload)) as reader:
            return reader.read(size)
    except zstandard.ZstdError as exc:
        raise BadRequest(f"the payload is not valid zstd ({exc})") from None


def check(payload: bytes, compress: bool, limit: int) -> None:
    """Before a payload is stored: its declared size (compressed) and its serialization header, from the
    first bytes alone. PayloadTooLarge (413) or BadRequest (422) naming the limit or the fault."""
    if compress:
        declared_size(payload, limit)
    start = _start(payload, compress, 2)
    if len(start) < 2 or start[0] != 0x80 or start[1] not in PROTOCOLS:
        raise BadRequest(
            "the payload is not what nnsight 0.8's client serialises (Python's object serialization, protocol 4"
            + (", zstd-compressed" if compress else "")
            + "): send it with nnsight's client (`remote=True`) or actq's Client.nnsight"
        )
