"""TorchComm: lockstep collectives over torch.distributed — NCCL on CUDA, gloo on CPU.

On GPUs NCCL is the right tool; on CPUs ``TcpComm`` measured >10x faster than gloo for
16 KB (NETWORK.md), so ``make_comm("auto", ...)`` only picks this one with CUDA.

Every gate message carries an int64 row (kind, layer, gate, sequence, dtype, size along
dim, rest) that every rank compares with its own, so every rank sees a desync and raises
``DesyncError`` together (no rank is left waiting in a collective). An all_reduce is one
collective: an all_gather of the row and the payload as bytes, summed here in rank order
(for 2 ranks the same bytes as a ring all-reduce, and bit-identical on every rank). An
all_gather first gathers the rows alone: they carry the per-rank sizes along ``dim``.
``check_tags=False`` sends a bare all_reduce instead. A tensor on another device than the
group's (a control message on the host, with NCCL) travels on the group's device and comes
back on its own.
This process holds the default process group: one TorchComm per process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from seamline.parallel.comm import (
    GATHER_TAG,
    CommError,
    DesyncError,
    GateTag,
    fingerprint_difference,
    sum_in_rank_order,
)

VERSION = (
    2  # 2: shared experts split per token (model/moe.py); a gate's tag and payload in one gather
)
REDUCE, GATHER = 1, 2
KIND_NAMES = {REDUCE: "reduce", GATHER: "gather"}
ROW_LEN = 7  # int64s in a gate's tag row
MAX_FINGERPRINT = 4096


class TorchComm:
    """Build with ``TorchComm.connect``; ``close`` destroys the process group."""

    def __init__(
        self, rank: int, world: int, device: torch.device, timeout_s: float, check_tags: bool
    ) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.timeout_s = timeout_s
        self.check_tags = check_tags

    @classmethod
    def connect(
        cls,
        rank: int,
        world: int,
        addresses: list[tuple[str, int]],
        timeout_s: float,
        fingerprint: str,
        check_tags: bool = True,
        device: torch.device | None = None,
    ) -> TorchComm:
        """Rendezvous at ``addresses[0]`` (rank 0 hosts the store), then check the HELLO fields.
        NCCL on ``device`` when it is a GPU (default: this process's current GPU, if any), else gloo."""
        if dist.is_initialized():
            raise CommError(
                "torch.distributed is already initialised in this process: one TorchComm per process"
            )
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        backend = "nccl" if device.type == "cuda" else "gloo"
        host, port = addresses[0]
        try:
            dist.init_process_group(
                backend,
                init_method=f"tcp://{host}:{port}",
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=timeout_s),
            )
        except (RuntimeError, ValueError) as exc:
            raise CommError(
                f"rank {rank} could not join the {backend} group at {host}:{port}: {exc}"
            ) from None
        comm = cls(rank, world, device, timeout_s, check_tags)
        try:
            comm._hello(fingerprint)
        except BaseException:
            comm.close()
            raise
        return comm

    def _hello(self, fingerprint: str) -> None:
        fp = fingerprint.encode()
        if len(fp) > MAX_FINGERPRINT:
            raise CommError(
                f"group fingerprint of {len(fp)} bytes exceeds the {MAX_FINGERPRINT} cap"
            )
        head = self._gather_rows(
            torch.tensor([VERSION, self.rank, self.world, len(fp)], dtype=torch.int64)
        )
        padded = torch.zeros(MAX_FINGERPRINT, dtype=torch.uint8)
        padded[: len(fp)] = torch.frombuffer(bytearray(fp), dtype=torch.uint8) if fp else padded[:0]
        prints = self._gather_rows(padded)
        for peer, (version, rank, world, length) in enumerate(head.tolist()):
            if version != VERSION:
                raise CommError(
                    f"protocol version mismatch: rank {self.rank} speaks {VERSION}, rank {peer} speaks {version}"
                )
            if world != self.world or rank != peer:
                raise CommError(
                    f"world mismatch: rank {self.rank} has world {self.world}, rank {peer} says "
                    f"rank {rank} of {world}"
                )
            theirs = bytes(prints[peer, :length].tolist()).decode(errors="replace")
            if theirs != fingerprint:
                raise CommError(
                    f"group mismatch: {fingerprint_difference(self.rank, fingerprint, peer, theirs)}"
                )

    def _gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """[world, *row.shape]: every rank's ``row``, in rank order."""
        row = row.to(self.device)
        out = [torch.empty_like(row) for _ in range(self.world)]
        self._call(lambda: dist.all_gather(out, row), "metadata")
        return torch.stack(out).cpu()

    @staticmethod
    def _row(kind: int, tag: GateTag, tensor: torch.Tensor, size: int, rest: int) -> list[int]:
        code = int.from_bytes(hashlib.sha1(str(tensor.dtype).encode()).digest()[:6], "little")
        return [kind, tag.layer, tag.gate, tag.sequence, code, size, rest]

    def _check(
        self, kind: int, tag: GateTag, tensor: torch.Tensor, size: int, rest: int
    ) -> list[int]:
        """Gather every rank's tag row and compare; return the ranks' sizes along the gather dim."""
        mine = self._row(kind, tag, tensor, size, rest)
        return self._compare(
            mine, self._gather_rows(torch.tensor(mine, dtype=torch.int64)).tolist(), tensor
        )

    def _compare(self, mine: list[int], rows: list[list[int]], tensor: torch.Tensor) -> list[int]:
        """DesyncError unless every rank's row matches ``mine``; the ranks' sizes."""
        kind, tag = mine[0], GateTag(mine[1], mine[2], mine[3])
        for peer, row in enumerate(rows):
            got = GateTag(row[1], row[2], row[3])
            if row[0] != kind or got != tag:
                raise DesyncError(
                    f"rank {self.rank} expected {KIND_NAMES[kind]} gate {tag}, "
                    f"got {KIND_NAMES.get(row[0], row[0])} gate {got} from rank {peer}"
                )
            if row[4] != mine[4] or row[6] != mine[6] or (kind == REDUCE and row[5] != mine[5]):
                raise DesyncError(
                    f"rank {peer}'s tensor for gate {tag} does not match rank {self.rank}'s "
                    f"(dtype {tensor.dtype}, shape {tuple(tensor.shape)})"
                )
        return [row[5] for row in rows]

    def all_reduce(self, tensor: torch.Tensor, tag: GateTag) -> torch.Tensor:
        if self.world == 1:
            return tensor
        if not self.check_tags:
            out = tensor.to(self.device).contiguous()
            self._call(lambda: dist.all_reduce(out, op=dist.ReduceOp.SUM), f"gate {tag}")
            return out.to(tensor.device)
        flat = tensor.detach().to(self.device).contiguous().view(-1)
        row = self._row(REDUCE, tag, tensor, flat.numel(), 1)
        header = torch.tensor(row, dtype=torch.int64).to(self.device).view(torch.uint8)
        mine = torch.cat([header, flat.view(torch.uint8)])
        gathered = [torch.empty_like(mine) for _ in range(self.world)]
        self._call(lambda: dist.all_gather(gathered, mine), f"gate {tag}")
        head = ROW_LEN * 8
        self._compare(
            row, torch.stack([g[:head] for g in gathered]).cpu().view(torch.int64).tolist(), tensor
        )
        parts = [g[head:].view(flat.dtype) for g in gathered]
        return sum_in_rank_order(parts, tensor.dtype).view(tensor.shape).to(tensor.device)

    def all_gather(self, tensor: torch.Tensor, dim: int, tag: GateTag = GATHER_TAG) -> torch.Tensor:
        if self.world == 1:
            return tensor
        if tensor.dim() == 0:
            raise CommError("all_gather needs a tensor with at least one dimension")
        dim = dim % tensor.dim()
        rest = tensor.numel() // tensor.shape[dim] if tensor.shape[dim] else 0
        sizes = self._check(GATHER, tag, tensor, tensor.shape[dim], rest)
        widest = max(sizes)
        pad = list(tensor.shape)
        pad[dim] = widest - tensor.shape[dim]  # gloo/NCCL gather equal sizes: pad, then trim
        mine = tensor.to(self.device)
        mine = (
            torch.cat([mine, mine.new_zeros(pad)], dim).contiguous()
            if pad[dim]
            else mine.contiguous()
        )
        out = [torch.empty_like(mine) for _ in range(self.world)]
        self._call(lambda: dist.all_gather(out, mine), f"gather gate {tag}")
        return torch.cat([part.narrow(dim, 0, size) for part, size in zip(out, sizes)], dim).to(
            tensor.device
        )

    def _call(self, op: Callable[[], object], what: str) -> None:
        try:
            op()
        except (RuntimeError, ValueError) as exc:  # DistBackendError is a RuntimeError
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CommError(
                f"rank {self.rank}: {what} failed (peer dead, silent for {self.timeout_s} s, "
                f"or gone): {first}"
            ) from None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
