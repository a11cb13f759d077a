"""A lockstep rank's comm port under `seamline bench fuzz`: rank 1 of a 2-rank TcpComm over
mutual TLS, formed again and again with whoever dials as rank 0, each group summing gates until
its stream breaks. Prints one JSON line when listening; runs until killed."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from seamline.net.tls import group_tls_from_folder
from seamline.parallel.comm import CommError, GateTag
from seamline.parallel.tcp_comm import TcpComm


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tls-dir", required=True)
    args = parser.parse_args()
    tls = group_tls_from_folder(Path(args.tls_dir), 1, 2)
    addresses = [("127.0.0.1", 9), ("127.0.0.1", args.port)]
    print(json.dumps({"ready": True}), flush=True)
    while True:
        try:
            comm = TcpComm.connect(1, 2, addresses, 2.0, "fuzz", connect_timeout_s=3600, tls=tls)
        except CommError:
            continue
        except (
            OSError
        ):  # the port is taken a moment (an outgoing connection's, between groups): listen again
            time.sleep(0.2)
            continue
        try:
            for sequence in range(1 << 30):
                comm.all_reduce(torch.ones(8), GateTag(0, 0, sequence))
        except CommError:
            pass
        finally:
            comm.close()


if __name__ == "__main__":
    sys.exit(main())
