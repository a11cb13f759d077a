"""Typed control messages, carried as JSON in CONTROL frames; one pydantic model per kind.

Every message is validated on arrival against its declared fields (unknown kinds, missing or
mistyped fields, extra fields are all refused), so a malformed control message is a clean
``FrameError`` rather than a KeyError deep in a handler.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, TypeAdapter, ValidationError

from seamline.net.check_messages import MAX_DIGEST_ROWS as MAX_DIGEST_ROWS
from seamline.net.check_messages import MAX_PROOF_BYTES as MAX_PROOF_BYTES
from seamline.net.check_messages import Digests as Digests
from seamline.net.check_messages import FrameProof as FrameProof
from seamline.net.check_messages import FrameProofPart as FrameProofPart
from seamline.net.check_messages import KeptRows as KeptRows
from seamline.net.check_messages import KeptRowsAsk as KeptRowsAsk
from seamline.net.check_messages import Probe as Probe
from seamline.net.check_messages import ProbeResult as ProbeResult
from seamline.net.check_messages import Receipt as Receipt
from seamline.net.frames import FrameError, FrameType, header
from seamline.net.message_base import MAX_REASON as MAX_REASON
from seamline.net.message_base import NODE_ID as NODE_ID
from seamline.net.message_base import Message as Message
from seamline.net.message_base import NodeName as NodeName
from seamline.net.message_base import Reason as Reason
from seamline.net.message_base import node_id_refusal as node_id_refusal
from seamline.params import SamplingParams

PROTOCOL_VERSION = 7  # 7: a signed statement carries its rows' SHA-256s, a receiver shows a lie (``FrameProof``); 6: a node's GPUs (``Resources.devices``), a stage's GPU share (``Assign.gpu_layers``); 5: the last stage's MTP drafts (``RowFlag.DRAFTS``, ``Assign.mtp``); 4: windows in flight (``RowFlag.FOLLOW``); 3: speculative windows (``RowFlag.WINDOW``, ``Route.speculation``); 2: a replay is a resume


class Challenge(Message):
    kind: Literal["challenge"] = "challenge"
    nonce: str
    protocol_version: int = PROTOCOL_VERSION
    # the coordinator's: the mesh CA (PEM), which the invite pins by fingerprint
    ca_certificate: str = ""


class DeviceResources(Message):
    """One accelerator of a node: what is free on it now and its measured weight-streaming rate."""

    device: str = Field(pattern=r"^[a-z]{1,16}(:[0-9]{1,3})?$")  # "cuda:0"
    free_memory_bytes: int = Field(ge=0)
    bytes_per_second: float = Field(gt=0, allow_inf_nan=False)


class Resources(Message):
    free_memory_bytes: int  # system memory
    bytes_per_second: float  # measured weight-streaming rate (its CPU's)
    device: str = "cpu"
    # Its GPUs, the one it computes on first ([] from a node without one, or one that predates them)
    devices: list[DeviceResources] = Field(default=[], max_length=16)
    cores: int = 1
    host: str = ""  # this machine's boot id: nodes that report the same one share its CPUs
    cpus: list[int] = Field(default=[], max_length=4096)  # the CPUs it may run on (affinity)
    # runs the int8-block matmuls (``--precision fast`` on quantized weights)
    int8_kernels: bool = False


class Holding(Message):
    """The stage a rejoining node still has loaded (a restarted coordinator may keep it)."""

    model_hash: str
    layers: tuple[int, int]
    owns_embedding: bool
    owns_head: bool
    dtype: str
    context_length: int
    int8_activations: bool = False
    gpu_layers: int | None = None  # split over its GPU and CPU (``Assign.gpu_layers``)

    @classmethod
    def of(cls, assign: Assign) -> Holding:
        """What a stage loaded for ``assign`` holds."""
        return cls(
            model_hash=assign.model_hash,
            layers=assign.layers,
            owns_embedding=assign.owns_embedding,
            owns_head=assign.owns_head,
            dtype=assign.dtype,
            context_length=assign.context_length,
            int8_activations=assign.int8_activations,
            gpu_layers=assign.gpu_layers,
        )


class Join(Message):
    kind: Literal["join"] = "join"
    node_id: str
    proof: str  # HMAC of the challenge nonce under the invite secret
    nonce: str = ""  # the node's challenge: the coordinator proves it holds the invite too
    protocol_version: int
    resources: Resources
    data_host: str
    data_port: int
    max_memory_bytes: int | None = None
    comm_port: int = 0  # where this node listens for lockstep peers (0: none)
    fragments_port: int = (
        0  # where it serves the fragments it holds to members, over mutual TLS (0: none)
    )
    csr: str = ""  # the node's certificate signing request (PEM), over TLS
    invite_id: str = ""  # which of the coordinator's invites ``proof`` proves
    holding: Holding | None = None  # a rejoin: the stage it has loaded


class Attach(Message):
    """An enrolled node's first word on its control link proper, under its own certificate."""

    kind: Literal["attach"] = "attach"
    node_id: str


class Rejoin(Message):
    """A member's first word when it dials a coordinator that lost it (restarted, or the link
    broke), under the certificate it already holds: its join, as before, without an invite."""

    kind: Literal["rejoin"] = "rejoin"
    join: Join


class Attached(Message):
    kind: Literal["attached"] = "attached"
    node_id: str


class Renew(Message):
    """A member asks for a fresh certificate for its key before its own expires."""

    kind: Literal["renew"] = "renew"
    csr: str = Field(max_length=4096)  # a P-256 request for a 64-character id is about 500


class Certificate(Message):
    """The coordinator's answer to a Renew: the member's new certificate (PEM)."""

    kind: Literal["certificate"] = "certificate"
    certificate: str


class DataHello(Message):
    """A stage dialling another's data port: who it is, for which plan, proved under the plan's
    link key (``mesh.node.data_links``)."""

    kind: Literal["data_hello"] = "data_hello"
    node_id: str
    plan_id: int
    proof: str


class ProbeHello(Message):
    """A member dialling another's data port only to measure the link (``mesh.node.peer_probe``):
    it may send a few pings and nothing else."""

    kind: Literal["probe_hello"] = "probe_hello"
    node_id: str


class Welcome(Message):
    kind: Literal["welcome"] = "welcome"
    node_id: str
    proof: str = ""  # the coordinator's answer to the node's nonce (``coordinator_proof``)
    certificate: str = ""  # the node's certificate from the mesh CA (PEM), over TLS


class Refuse(Message):
    kind: Literal["refuse"] = "refuse"
    reason: str
    final: bool = False  # asking again will not help (a removed node, a wrong certificate): a rejoining node stops


class Assign(Message):
    kind: Literal["assign"] = "assign"
    plan_id: int
    model_hash: str
    fragments_url: str
    fragments_certificate: str = (
        ""  # PEM of the coordinator's HTTPS certificate, when it serves over TLS
    )
    fragments_token: str = (
        ""  # this member's bearer token for fragment downloads (void once it leaves)
    )
    fragment_peers: list[
        str
    ] = []  # members' fragment URLs, tried first (a fragment is checked by its hash)
    layers: tuple[int, int]
    owns_embedding: bool
    owns_head: bool
    dtype: str
    context_length: int
    int8_activations: bool = (
        False  # the coordinator's precision: int8 blocks in the quantized matmuls
    )
    rows_alone: bool = False  # and every int8 row computed as alone (``Precision.rows_alone``)
    mtp: bool = False  # the last stage: with the model's multi-token-prediction layer, which drafts
    memory_bytes: int = 0  # weights + KV cache the plan expects this node to hold in system memory
    # Where the stage's layers run (``StageAssignment.gpu_layers``): None, all on the node's own device;
    # N, its first N layers (with the embedding) on its GPU (``Resources.devices[0]``), the rest and the head on its CPU
    gpu_layers: int | None = Field(default=None, ge=0)
    # A lockstep group: this node is rank shard[0] of shard[1]; ``group`` has every rank's
    # comm address in rank order, ``group_nodes`` their node ids. (0, 1) and [] for a stage of one node.
    shard: tuple[int, int] = (0, 1)
    group: list[tuple[str, int]] = []
    group_nodes: list[str] = []
    transport: str = "tcp"
    gate_timeout_s: float = 30.0
    kv_cache_bytes: int = (
        0  # stage 0: the KV budget it admits requests into (0: most of its free memory)
    )
    link_key: str = ""  # this plan's key for data links between its stages
    upstream_node: str = ""  # the node that may send this stage hidden frames ("" for stage 0)
    last_node: str = ""  # stage 0 of several: the last stage, which sends it tokens
    digest_seed: int = (
        0  # report a digest of every row received and computed (``Digests``); 0: none
    )
    # A private mesh (``--private``): this node, the coordinator's own, is also the last stage, holding
    # the layers ``tail`` and the head, and draws; the members between see no token id.
    tail: tuple[int, int] | None = None


class Descriptor(Message):
    """What a loaded stage is: checked against the plan before the route is published."""

    node_id: NodeName
    plan_id: int
    model_hash: str = Field(max_length=128)
    layers: tuple[int, int]
    dtype: str = Field(max_length=32)
    int8_activations: bool = False  # what its quantized matmuls run (Assign's)
    protocol_version: int
    shard: tuple[int, int] = (0, 1)
    tail: tuple[int, int] | None = None  # a private mesh's last layers, held beside ``layers``


class Ready(Message):
    kind: Literal["ready"] = "ready"
    descriptor: Descriptor
    bytes_downloaded: int = 0
    bytes_from_peers: int = 0  # of bytes_downloaded: from other members, not the coordinator
    resident_bytes: int = 0


class Loading(Message):
    """A node fetching its assignment's fragments: how far it has come (sent every second or so)."""

    kind: Literal["loading"] = "loading"
    plan_id: int
    bytes_done: int
    bytes_total: int


class Route(Message):
    kind: Literal["route"] = "route"
    plan_id: int
    downstream: tuple[str, int] | None  # next stage's data address (None: last stage)
    stage0: tuple[str, int] | None  # where the last stage sends tokens (None: not last)
    downstream_node: str = ""  # the node ids a certificate must name at those addresses
    stage0_node: str = ""
    downstream_relay: str = (
        ""  # a relay ticket: ``downstream`` is the coordinator's relay, not the node
    )
    stage0_relay: str = ""
    stages: int = (
        1  # stages in the pipeline: stage 0 keeps at least this many micro-batches in flight
    )
    micro_batches: int = 0  # more micro-batches in flight than stages (0: as many as stages)
    forks: bool = False  # every stage can copy a cache (no lockstep group): stage 0 shares prefixes
    speculation: Literal["off", "auto", "ngram", "mtp"] = (
        "off"  # stage 0 drafts windows (``runtime/speculation.py``)
    )
    draft_max: int = Field(default=8, ge=1, le=32)


class RelayAccept(Message):
    """Coordinator -> a node that takes no inbound connection: dial the relay with this ticket
    and serve what comes through as a data link from ``peer_node``."""

    kind: Literal["relay_accept"] = "relay_accept"
    ticket: str
    peer_node: str
    probe: bool = False  # the link only measures the pair (``MeasurePeer``)


class MeasurePeer(Message):
    """Coordinator -> node: measure the link to ``peer_node`` (its data port, or through the
    relay with ``relay``, a ticket) and answer with a PeerLink."""

    kind: Literal["measure_peer"] = "measure_peer"
    peer_node: str
    host: str
    port: int
    relay: str = ""


class PeerLink(Message):
    """Node -> coordinator: the link to ``peer_node`` as measured (``error`` when it could not be)."""

    kind: Literal["peer_link"] = "peer_link"
    peer_node: NodeName
    latency_s: float = 0.0  # one-way
    bandwidth_bytes_per_s: float = 0.0
    error: Reason = ""


class Ping(Message):
    """Coordinator -> node, answered at once with a Pong: the link's round trip, and with a
    ``pad`` its bandwidth."""

    kind: Literal["ping"] = "ping"
    pad: str = ""  # before the nonce: a pong cannot leave before the whole pad has come
    nonce: int


class Pong(Message):
    kind: Literal["pong"] = "pong"
    nonce: int


class SpeedProbe(Message):
    """Coordinator -> a joining node: make the seeded matrix (no ``vector``: answer SpeedReady),
    then, given ``vector``, answer the product's row-block sums at once (``mesh.protocol.claims``)."""

    kind: Literal["speed_probe"] = "speed_probe"
    seed: int
    rows: int = Field(gt=0, le=1 << 16)
    cols: int = Field(gt=0, le=1 << 12)
    vector: list[float] = []


class SpeedReady(Message):
    kind: Literal["speed_ready"] = "speed_ready"


class SpeedSums(Message):
    kind: Literal["speed_sums"] = "speed_sums"
    sums: list[float] = Field(max_length=1024)  # one per block of the probe (``claims.BLOCKS``: 64)


class Linked(Message):
    kind: Literal["linked"] = "linked"
    plan_id: int


class Open(Message):
    kind: Literal["open"] = "open"
    request: int
    sampling: SamplingParams  # with the seed chosen: every stage draws alike
    # the prompt's tokens; its Prompt chunks may carry more: the tokens a request resumed on a
    # new route (``mesh_backend``) drew before, recomputed as a preempted sequence's are
    prompt_len: int
    context_length: int


PROMPT_CHUNK_TOKENS = (
    32768  # a chunk's JSON stays far below the control cap (at most ~11 bytes a token)
)


class Prompt(Message):
    """Coordinator -> stage 0: a request's tokens, in chunks of at most ``PROMPT_CHUNK_TOKENS``
    (a prompt near a long context would not fit one control frame); ``more``: chunks follow."""

    kind: Literal["prompt"] = "prompt"
    request: int
    tokens: tuple[int, ...] = Field(max_length=PROMPT_CHUNK_TOKENS)
    more: bool = False

    @classmethod
    def chunks(cls, request: int, tokens: list[int]) -> list[Prompt]:
        """``tokens`` as the chunks that carry them, in order."""
        step = PROMPT_CHUNK_TOKENS
        parts = [tuple(tokens[i : i + step]) for i in range(0, max(len(tokens), 1), step)]
        return [
            cls(request=request, tokens=part, more=i < len(parts) - 1)
            for i, part in enumerate(parts)
        ]


class Close(Message):
    kind: Literal["close"] = "close"
    request: int


class Fork(Message):
    """Stage 0 -> later stages, in order with the frames: ``request``'s cache starts over as a
    copy of positions [0, positions) of ``donor``'s (a running or kept request's), whose tokens
    hash to ``hash`` (a shared prompt prefix)."""

    kind: Literal["fork"] = "fork"
    request: int
    donor: int
    positions: int
    hash: int


class Forget(Message):
    """Stage 0 -> later stages, in order with the frames: free ``request``'s cache. Stage 0
    decides every cache's lifetime, since it keeps finished ones for prompts that begin alike."""

    kind: Literal["forget"] = "forget"
    request: int


class Failure(Message):
    """A node's failure report. ``plan_id`` is set when the lockstep group it serves in broke
    (a gate's link closed or timed out): ``suspect`` then names the rank's node at fault, when known."""

    kind: Literal["failure"] = "failure"
    request: int | None = None
    reason: Reason
    blame: Literal["node", "request", "load", "frame"] = (
        "node"  # a stage failed / the request is invalid / too busy / it refused the request's frame
    )
    plan_id: int | None = None
    suspect: NodeName | None = None
    room_bytes: int | None = (
        None  # a stage it could not load: the memory it has (planned with no more)
    )


class StatsRequest(Message):
    kind: Literal["stats_request"] = "stats_request"


class Stats(Message):
    """A stage's counters: decode steps run and the compute seconds they took; the sequences
    it holds open and the KV cache bytes they hold, and the KV of finished requests kept for
    prompts that begin alike."""

    kind: Literal["stats"] = "stats"
    node_id: NodeName
    decode_steps: int
    decode_seconds: float
    refused_frames: int
    sequences: int = 0
    kv_bytes: int = 0
    kept_kv_bytes: int = 0
    micro_batches: int = 0  # stage 0: micro-batches it keeps in flight
    precision: str = Field(
        default="", max_length=64
    )  # what this stage computes in (``Precision.describe``)
    link_bytes: dict[NodeName, int] = Field(
        default={}, max_length=64
    )  # bytes sent so far over its data link to each node
    windows: int = 0  # stage 0: speculative windows verified, tokens drafted and accepted, so far
    drafted: int = 0
    accepted: int = 0
    follows: int = 0  # stage 0: windows sent on while one of the sequence's was in flight
    # the last stage: windows sent on after one not accepted whole, not drawn from
    stale_windows: int = 0
    # Its speed probe after loading (``runtime.step_probe``): rows -> seconds of one step of that many decode rows
    step_probe_s: dict[int, float] = Field(default={}, max_length=8)
    prompt_probe_s: dict[int, float] = Field(
        default={}, max_length=8
    )  # and of a step of that many prompt rows
    # rows -> a decode step's median seconds outside its forward (``runtime.step_clock``)
    step_overhead_s: dict[int, float] = Field(default={}, max_length=8)
    probe_quiet: bool = False  # the probe was taken again on an idle stage and quiet cores
    cycle_wall_s: float = 0.0  # a stage after the first: one row's wall s, taken to handed on
    ring_s: float = 0.0  # stage 0: one stream's row from leaving it to its token back, wall s
    busy_seconds: float = 0.0  # every forward's seconds so far, prompt chunks' too
    idle_seconds: float = 0.0  # waiting with nothing to run so far (``runtime.idle_clock``)


class Heartbeat(Message):
    kind: Literal["heartbeat"] = "heartbeat"


class Revoked(Message):
    """Coordinator -> every member: every node removed from the mesh, sent as a member attaches
    and on each removal. A removed node's certificate stays valid until it expires, so each
    member refuses it itself (fragments, data and probe links) and drops the links it holds."""

    kind: Literal["revoked"] = "revoked"
    node_ids: list[str]


AnyMessage = Annotated[
    Challenge
    | Join
    | Attach
    | Rejoin
    | Attached
    | Renew
    | Certificate
    | RelayAccept
    | MeasurePeer
    | PeerLink
    | Ping
    | Pong
    | SpeedProbe
    | SpeedReady
    | SpeedSums
    | DataHello
    | ProbeHello
    | Welcome
    | Refuse
    | Assign
    | Ready
    | Loading
    | Route
    | Linked
    | Open
    | Prompt
    | Close
    | Fork
    | Forget
    | Failure
    | StatsRequest
    | Stats
    | Heartbeat
    | Revoked
    | Probe
    | ProbeResult
    | KeptRowsAsk
    | KeptRows
    | Digests
    | FrameProof
    | FrameProofPart,
    Field(discriminator="kind"),
]
_ADAPTER: TypeAdapter[AnyMessage] = TypeAdapter(AnyMessage)


def encode_message(message: Message) -> bytes:
    body = message.model_dump_json().encode()
    return header(FrameType.CONTROL, len(body)) + body


def decode_message(payload: bytes | bytearray | memoryview) -> Message:
    try:
        return _ADAPTER.validate_json(bytes(payload))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise FrameError(f"malformed control message: {where}: {first.get('msg')}") from None
