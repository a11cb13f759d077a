"""Collectives for the lockstep (tensor/expert) split.

Model code talks to one ``Comm`` (``comm.py``): ``SingleComm`` for one rank (a no-op, so the
split model is the single-machine model), ``TcpComm`` (``tcp_comm.py``: a full mesh of
persistent TCP sockets, fastest on CPUs) or ``TorchComm`` (``torch_comm.py``:
torch.distributed, NCCL on GPUs). ``make_comm`` chooses. Every gate message carries a
``GateTag`` so ranks that fall out of step raise ``DesyncError`` instead of summing garbage.
"""

from seamline.parallel.comm import Comm, CommError, DesyncError, GateTag, SingleComm
from seamline.parallel.connect import make_comm

__all__ = ["Comm", "CommError", "DesyncError", "GateTag", "SingleComm", "make_comm"]
