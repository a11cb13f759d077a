"""Lockstep group in real processes: N ranks hold 1/N of one model and compute every token together.

Each rank loads only its shard (``Ownership(shard=(rank, world))``: query heads and FFN rows
split evenly, routed experts ``[r*E/N, (r+1)*E/N)`` — E must divide by N, or the gates
would be summed over an uneven split we do not test — and vocabulary rows
``[r*V/N, (r+1)*V/N)``, a floor partition that need not be even since ``all_gather`` takes
unequal slices). Ranks join through a Comm (``make_comm``: tcp or torch) whose HELLO
fingerprint names the model (identity, config hash, a digest of replicated weights), dtype,
world, layer range and gate schedule.

A group may own the whole model or one pipeline stage's layer range: a stage that does not
own the embedding takes hidden states instead of token ids, and one that does not own the
head returns hidden states instead of logits (every rank holds the full residual stream
after each gate, so the leader's output is complete).

Control protocol (over the Comm itself, no second socket): before every session call the
leader (rank 0) and every other rank all-reduce an int64 command ``[op, seq_id, position,
n_tokens, flags, token, 0, 0]`` (non-leaders contribute zeros) tagged ``GateTag(-2, 0, k)``;
one token id rides in ``token``, more inputs follow tagged ``GateTag(-2, 1, k)``: token ids
``[n_tokens]``, or hidden states ``[n_tokens, hidden]`` (others add zeros: the sum is the
leader's, exactly). A BATCH command (``[BATCH, n_spans, 0, n_rows, ...]``) runs many sequences'
rows in one forward: its span table ``[n_spans, 4]`` of (seq_id, position, rows, flags) follows
tagged ``GateTag(-2, 2, k)``, then the rows; every gate then carries ``[n_rows, hidden]``, and
the last stage gathers each span's last-position logits, and every row's of a speculative
window (flag ``WINDOW``; its next rows may start at any position of the windows since its last
plain rows, so a rejected draft needs no REWIND), or (max, argmax) pairs when every sequence in it is greedy. Every rank then applies the same call to its own caches; prefill/decode
run the Stage (two gates per layer) and, on the last stage, all-gather the vocab-shard logits
of the last position (``GateTag(-1, 0, step)``) — or, for a sequence created with the GREEDY
flag, only each shard's (max, argmax) pair: an exact argmax for 16 bytes instead of V/N
floats; the leader samples (its side, ``LockstepGroup``, is ``lockstep_leader.py``). While
idle, the leader sends PING every ``timeout_s / 3`` s, so a non-leader's gate timeout only
fires when the leader is really gone. A dead rank surfaces as a CommError naming it (TcpComm: "rank R closed the
link" / "sent nothing ... within T s").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from seamline.config import ModelConfig
from seamline.errors import ConfigError, RequestError, SeamlineError
from seamline.model.cache import SequenceCache, Span, logit_rows
from seamline.model.devices import resolve_device, to_host
from seamline.model.linear import leading_bytes
from seamline.model.stage import Stage
from seamline.net.tls import GroupTls, group_tls_from_folder
from seamline.ownership import rank_ownership
from seamline.parallel.comm import Comm, CommError, GateTag, Transport
from seamline.parallel.connect import make_comm
from seamline.weights.loader import DTYPES, fill_stage, open_source, settle_stage
from seamline.weights.source import TensorSource

CREATE, PREFILL, DECODE, REWIND, DESTROY, PING, SHUTDOWN, BATCH, FORK = range(1, 10)
OP_NAMES = {
    CREATE: "create",
    PREFILL: "prefill",
    DECODE: "decode",
    REWIND: "rewind",
    DESTROY: "destroy",
    PING: "ping",
    SHUTDOWN: "shutdown",
    BATCH: "batch",
    FORK: "fork",
}
DONOR = 6  # command slot: a FORK's donor sequence
MAX_BATCH_ROWS = (
    4096  # rows of one BATCH command (decode rows and prefill chunks of many sequences)
)
CMD_LEN = 8
GREEDY = 1  # command flag (create): exchange (max, argmax) pairs, not whole logits
SPAN_COLUMNS = 4  # a BATCH's span table: (seq, position, rows, flags)
WINDOW = 1  # span flag: a speculative window (``runtime/speculation.py``): computed row by row, each row's logits
CONTROL_LAYER = -2  # GateTag layer of control messages (model gates use >= 0, logits -1)
PREFILL_CHUNK = 512


class HiddenWithIds(NamedTuple):
    """A later stage's inputs where its layers route by token id (DeepSeek-V4): the residual
    and the rows' ids (tagged ``GateTag(-2, 3, k)`` after the residual)."""

    hidden: torch.Tensor
    ids: torch.Tensor


Inputs = (
    list[int] | torch.Tensor | HiddenWithIds
)  # token ids (a stage with the embedding) or hidden states


def input_rows(inputs: Inputs | None) -> int:
    if inputs is None:
        return 0
    return len(inputs.hidden) if isinstance(inputs, HiddenWithIds) else len(inputs)


def group_fingerprint(
    identity: str, source_config: dict, stage: Stage, dtype: torch.dtype, world: int
) -> str:
    """Model identity + dtype + world + layers + gate schedule: what every rank must share."""
    config_hash = hashlib.sha256(json.dumps(source_config, sort_keys=True, default=str).encode())
    weights = hashlib.sha256()  # replicated tensors only: equal on every rank of one checkpoint
    first_block: Any = next(iter(stage.layers.values()))
    replicated = (
        stage.norm.weight if stage.norm is not None else None,
        stage.embed,
        first_block.input_norm.weight,
    )
    for tensor in replicated:
        if tensor is not None:
            weights.update(leading_bytes(tensor, 4096))
    start, end = stage.ownership.layers
    return (
        f"{identity}|config:{config_hash.hexdigest()[:16]}|weights:{weights.hexdigest()[:16]}"
        f"|{str(dtype).removeprefix('torch.')}|world:{world}|layers:{start}-{end}|gates:2x{end - start}"
    )


class _LateComm:
    """Stands in for the Comm while the Stage loads (the fingerprint needs the weights)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.inner: Comm | None = None

    def _comm(self) -> Comm:
        if self.inner is None:
            raise CommError(f"rank {self.rank} used its comm before the group connected")
        return self.inner

    def all_reduce(self, tensor: torch.Tensor, tag: GateTag) -> torch.Tensor:
        return self._comm().all_reduce(tensor, tag)

    def all_gather(
        self, tensor: torch.Tensor, dim: int, tag: GateTag = GateTag(-1, 0, 0)
    ) -> torch.Tensor:
        return self._comm().all_gather(tensor, dim, tag)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


@dataclass
class _GroupSequence:
    cache: SequenceCache
    position: int = 0  # the next position
    greedy: bool = False  # the leader samples greedily: (max, argmax) pairs suffice
    floor: int = (
        0  # the earliest position its next rows may start at: after windows, the first one's start
    )
    windowed: bool = False  # its last rows were a speculative window


class LockstepRank:
    """One rank: its shard of the model, its caches, and the control exchange."""

    def __init__(
        self,
        model: str | Path | TensorSource,
        rank: int,
        world: int,
        addresses: list[tuple[str, int]],
        timeout_s: float = 30.0,
        dtype: torch.dtype = torch.float32,
        connect_timeout_s: float = 60.0,
        *,
        transport: Transport = "tcp",
        layers: tuple[int, int] | None = None,
        identity: str | None = None,
        tls: GroupTls | None = None,
        device: torch.device | None = None,
    ) -> None:
        """Load this rank's shard of ``layers`` from ``model`` (a path, or an open source with
        an ``identity`` naming its model) onto ``device`` (default: the CPU), then join the group
        over ``transport`` (NCCL's collectives run on this rank's GPU: its current device)."""
        if isinstance(model, (str, Path)):
            source, identity = open_source(Path(model)), identity or Path(model).name
        elif identity is None:
            raise ConfigError(
                "a lockstep rank given an open weight source needs the model's identity"
            )
        else:
            source = model
        raw_config = source.config_dict()
        self.config = ModelConfig.from_hf_dict(raw_config)
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.comm = _LateComm(rank, world)
        own = rank_ownership(self.config, rank, world, layers)
        self.first, self.last = own.owns_embedding(), own.owns_head(self.config)
        self.stage = fill_stage(source, own, dtype, self.config, comm=self.comm)
        self.fingerprint = group_fingerprint(
            identity, raw_config, self.stage, dtype, world
        )  # read on the host
        settle_stage(self.stage, device)
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        self.comm.inner = make_comm(
            transport,
            rank,
            world,
            addresses,
            timeout_s,
            self.fingerprint,
            connect_timeout_s,
            tls,
            device=device or torch.device("cpu"),
        )
        self.seqs: dict[int, _GroupSequence] = {}
        self._control = 0  # control messages so far: the sequence of their tags

    def exchange(
        self, cmd: list[int] | None, inputs: Inputs | None = None, spans: torch.Tensor | None = None
    ) -> tuple[list[int], Inputs | None, torch.Tensor | None]:
        """Leader: send (cmd, inputs[, a BATCH's span table]); others: pass None and receive them."""
        tag = self._control
        self._control += 1
        mine = torch.zeros(CMD_LEN, dtype=torch.int64)
        if cmd is not None:
            mine[: len(cmd)] = torch.tensor(cmd, dtype=torch.int64)
            if self.first and inputs is not None and len(inputs) == 1:
                mine[5] = int(inputs[0])  # one token id travels in the command itself
        got = self.comm.all_reduce(mine, GateTag(CONTROL_LAYER, 0, tag)).tolist()
        count, batch = got[3], got[0] == BATCH
        if not 0 <= count <= (MAX_BATCH_ROWS if batch else PREFILL_CHUNK):
            raise CommError(f"rank {self.rank} got a command with {count} tokens")
        table = self._span_table(got[1], spans, tag) if batch else None
        if count == 0:
            return got, None, table
        if self.first and count == 1:
            return got, torch.tensor([got[5]], dtype=torch.int64), table
        shape: tuple[int, ...]
        if self.first:  # token ids
            shape, dtype = (count,), torch.int64
        else:  # hidden states from the previous stage
            shape, dtype = (count, *self.stage.boundary_shape), self.stage.compute_dtype
        given = inputs.hidden if isinstance(inputs, HiddenWithIds) else inputs
        payload = (
            torch.zeros(shape, dtype=dtype) if given is None else torch.as_tensor(given).to(dtype)
        )
        if tuple(payload.shape) != shape:
            raise RequestError(
                f"lockstep input of shape {tuple(payload.shape)}; this group takes {shape}"
            )
        hidden = self.comm.all_reduce(payload, GateTag(CONTROL_LAYER, 1, tag))
        if self.first or not self.stage.passes_ids:
            return got, hidden, table
        ids = (
            inputs.ids
            if isinstance(inputs, HiddenWithIds)
            else torch.zeros(count, dtype=torch.int64)
        )
        return (
            got,
            HiddenWithIds(hidden, self.comm.all_reduce(ids.long(), GateTag(CONTROL_LAYER, 3, tag))),
            table,
        )

    def _span_table(self, n_spans: int, spans: torch.Tensor | None, tag: int) -> torch.Tensor:
        if not 0 < n_spans <= MAX_BATCH_ROWS:
            raise CommError(f"rank {self.rank} got a batch of {n_spans} sequences")
        mine = torch.zeros(n_spans, SPAN_COLUMNS, dtype=torch.int64) if spans is None else spans
        return self.comm.all_reduce(mine, GateTag(CONTROL_LAYER, 2, tag))

    def apply(
        self, cmd: list[int], inputs: Inputs | None, table: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Run one session call on this rank; prefill/decode return the full last-position
        logits (last stage) or the hidden states of every position (earlier stages); a batch,
        each span's last logits [spans, vocab] or every row's hidden states."""
        op, seq, position = cmd[0], cmd[1], cmd[2]
        if op in (PING, SHUTDOWN):
            return None
        if op == BATCH:
            assert table is not None
            return self._apply_batch(inputs, table)
        if op == CREATE:
            if seq in self.seqs:
                raise RequestError(f"sequence {seq} already exists on rank {self.rank}")
            self.seqs[seq] = _GroupSequence(self.stage.new_cache(), greedy=bool(cmd[4] & GREEDY))
            return None
        if op == FORK:
            self._fork(seq, cmd[DONOR], position)
            return None
        state = self.seqs.get(seq)
        if state is None:
            raise RequestError(
                f"sequence {seq} does not exist on rank {self.rank} ({OP_NAMES.get(op, op)})"
            )
        if op == DESTROY:
            del self.seqs[seq]
            return None
        if op == REWIND:
            if not 0 <= position <= state.position:
                raise RequestError(
                    f"rewind of sequence {seq} to {position}: must be in [0, {state.position}]"
                )
            if (
                position != state.position and not self.stage.forks_caches
            ):  # (a V4 cache goes back at its next step)
                raise RequestError(
                    f"sequence {seq} cannot be rewound: this model's caches forget what they pass"
                )
            state.position = state.floor = position
            state.windowed = False
            return None
        if op not in (PREFILL, DECODE):
            raise CommError(f"rank {self.rank} got unknown lockstep op {op}")
        count = input_rows(inputs)
        if not state.floor <= position <= state.position or not count:
            raise RequestError(
                f"sequence {seq} is at position {state.position}; {OP_NAMES[op]} came for "
                f"{position} with {count} tokens"
            )
        assert inputs is not None
        out = self._forward(inputs, [Span(0, count, position, state.cache)])
        state.position = state.floor = position + count
        state.windowed = False
        if not self.last:
            return out
        return self._gather_logits(out[-1].float(), state.greedy)

    def _fork(self, seq: int, donor_seq: int, position: int) -> None:
        """A new sequence ``seq`` holding a copy of ``donor_seq``'s positions [0, position)."""
        donor = self.seqs.get(donor_seq)
        if seq in self.seqs or donor is None:
            raise RequestError(
                f"fork of sequence {donor_seq} into {seq} on rank {self.rank}: not one open, one free"
            )
        if not self.stage.forks_caches or not 0 <= position <= donor.position:
            raise RequestError(
                f"sequence {donor_seq} (at {donor.position}) cannot be copied through {position}"
            )
        self.seqs[seq] = _GroupSequence(
            donor.cache.fork(position), position, donor.greedy, floor=position
        )

    def _forward(self, inputs: Inputs, spans: list[Span]) -> torch.Tensor:
        """Hidden states of every row, or on the last stage the logits of each span's last row
        and of every row of a speculative window (``logit_rows``)."""
        windowed = self.last and any(s.rowwise for s in spans)
        rows: dict[str, Any] = (
            {"logit_rows": logit_rows(spans)} if windowed else {"last_only": self.last}
        )
        if isinstance(inputs, HiddenWithIds):
            return self.stage.forward_batch(inputs.hidden, spans, ids=inputs.ids, **rows)
        return self.stage.forward_batch(torch.as_tensor(inputs), spans, **rows)

    def _apply_batch(self, inputs: Inputs | None, table: torch.Tensor) -> torch.Tensor:
        """Every span checked first (all ranks hold the same sequences, so all refuse alike),
        then one forward for all their rows."""
        spans, states, offset = [], [], 0
        for seq, position, count, flags in table.tolist():
            state = self.seqs.get(seq)
            if state is None or not state.floor <= position <= state.position or count <= 0:
                where = "does not exist" if state is None else f"is at position {state.position}"
                raise RequestError(
                    f"sequence {seq} {where}; a batch came for {position} with {count} rows"
                )
            spans.append(Span(offset, count, position, state.cache, rowwise=bool(flags & WINDOW)))
            states.append(state)
            offset += count
        if inputs is None or input_rows(inputs) != offset:
            raise RequestError(f"a batch of {offset} rows came with {input_rows(inputs)}")
        out = self._forward(inputs, spans)
        for state, span in zip(
            states, spans
        ):  # a window's drafts past the accepted are written over later
            state.position = span.start + span.count
            if (
                span.rowwise
            ):  # windows in flight: the next rows may go back into any since the last plain row
                state.floor = min(state.floor, span.start) if state.windowed else span.start
            else:
                state.floor = state.position
            state.windowed = span.rowwise
        if not self.last:
            return out
        return self._gather_batch_logits(out.float(), all(s.greedy for s in states))

    def _gather_batch_logits(self, local: torch.Tensor, greedy: bool) -> torch.Tensor:
        """[spans, vocab]: the gathered shards, or for greedy sequences -inf but at each row's
        argmax (the first highest over the shards, in vocabulary order)."""
        tag = GateTag(-1, 0, self.stage.step)
        if not greedy:
            return self.comm.all_gather(local, -1, tag)
        values, index = local.max(dim=-1)  # the first maximum of each row
        start = self.stage.ownership.vocab_range(self.config)[0]
        pairs = torch.stack((values.double(), (index + start).double()), dim=-1)  # [spans, 2]
        every = to_host(self.comm.all_gather(pairs, 0, tag)).view(
            self.world, -1, 2
        )  # rank order: ascending vocab
        best = every[:, :, 0].argmax(dim=0)  # the first of equal maxima
        rows = torch.arange(every.shape[1])
        logits = torch.full((every.shape[1], self.config.vocab_size), float("-inf"))
        logits[rows, every[best, rows, 1].long()] = every[best, rows, 0].float()
        return logits

    def _gather_logits(self, local: torch.Tensor, greedy: bool) -> torch.Tensor:
        """The whole vocabulary's logits [V]; for greedy, a vector that is -inf but at the
        argmax: each rank offers its shard's (max, argmax) and the first highest wins, the
        very token an argmax over the gathered logits would give."""
        tag = GateTag(-1, 0, self.stage.step)
        if not greedy:
            return self.comm.all_gather(local, -1, tag)
        index = int(
            local.argmax()
        )  # the first maximum, as the sampler's argmax (on the rank's device)
        start = self.stage.ownership.vocab_range(self.config)[0]
        pair = torch.tensor([float(local[index]), float(start + index)], dtype=torch.float64)
        pairs = self.comm.all_gather(pair, 0, tag).view(-1, 2)  # rank order: ascending vocab
        best = int(pairs[:, 0].argmax())  # torch takes the first of equal maxima too
        logits = torch.full((self.config.vocab_size,), float("-inf"))
        logits[int(pairs[best, 1])] = float(pairs[best, 0])
        return logits

    def serve(self) -> None:
        """Non-leader loop: apply every command the leader sends until SHUTDOWN."""
        if self.rank == 0:
            raise ConfigError("rank 0 is the leader; serve() is the loop of the other ranks")
        while True:
            cmd, inputs, table = self.exchange(None)
            if cmd[0] == SHUTDOWN:
                return
            try:
                self.apply(cmd, inputs, table)
            except RequestError:  # the leader met the same error in the same call: in step
                continue

    def close(self) -> None:
        self.comm.close()


def parse_addresses(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"address {item!r} is not host:port")
        out.append((host, int(port)))
    return out


def main(argv: list[str] | None = None) -> int:
    """Run a non-leader rank until the leader shuts the group down or a link breaks."""
    ap = argparse.ArgumentParser(prog="python -m seamline.runtime.lockstep_group")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--addresses", required=True, help="host:port per rank, comma-separated")
    ap.add_argument("--model", required=True)
    ap.add_argument("--timeout", type=float, default=30.0, help="gate timeout, seconds")
    ap.add_argument("--connect-timeout", type=float, default=60.0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--transport", choices=["auto", "tcp", "torch"], default="tcp")
    ap.add_argument("--layers", help="START:END, the pipeline stage this group owns (default: all)")
    ap.add_argument(
        "--device", default="cpu", help="where this rank computes: cpu, cuda, cuda:N (default cpu)"
    )
    ap.add_argument(
        "--tls-dir", help="mutual TLS (tcp): ca.pem, rank{R}.pem and rank{R}.key in this folder"
    )
    args = ap.parse_args(argv)
    try:
        if args.rank == 0:
            raise ConfigError("rank 0 is the leader and runs in the serving process, not here")
        layers = tuple(int(v) for v in args.layers.split(":")) if args.layers else None
        rank = LockstepRank(
            args.model,
            args.rank,
            args.world,
            parse_addresses(args.addresses),
            args.timeout,
            DTYPES[args.dtype],
            args.connect_timeout,
            transport=args.transport,
            layers=layers,
            device=resolve_device(args.device),  # type: ignore[arg-type]
            tls=group_tls_from_folder(Path(args.tls_dir), args.rank, args.world)
            if args.tls_dir
            else None,
        )
        try:
            rank.serve()
        finally:
            rank.close()
    except (SeamlineError, OSError) as exc:
        print(f"seamline lockstep rank {args.rank}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
