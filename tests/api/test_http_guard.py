"""The API's listener under an attacker's idle connections: a connection that has sent no whole
request head within the deadline is closed, connections without a request are bounded per
address and in all (the oldest cut), so a process with few descriptors keeps serving new
clients while a stranger holds many more connections than it has descriptors."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import httpx

from seamline.net.link import free_port

SERVER = textwrap.dedent("""
    import resource, sys
    import uvicorn
    from fastapi import FastAPI
    from seamline.net import http_guard
    http_guard.HEAD_DEADLINE_S = 2.0
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    app = FastAPI()
    app.get("/health")(lambda: {"ok": True})
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", http=http_guard.guarded())
""")


def _idle(port: int, count: int) -> list[socket.socket]:
    held = []
    for _ in range(count):
        try:
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break
    return held


def test_idle_connections_beyond_the_descriptors_do_not_shut_clients_out() -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port)], stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        held = _idle(port, 400)  # more than the server's 256 descriptors
        assert len(held) == 400
        with httpx.Client(timeout=5) as client:  # a new client's connection, while they are held
            for _ in range(5):
                assert (
                    client.get(
                        f"http://127.0.0.1:{port}/health", headers={"Connection": "close"}
                    ).status_code
                    == 200
                )
        drip = socket.create_connection(("127.0.0.1", port), timeout=5)
        began = time.monotonic()
        drip.sendall(b"GET /health HTTP/1.1\r\n")
        closed = None
        while closed is None and time.monotonic() - began < 8:
            try:
                drip.sendall(b"X-Drip: 1\r\n")
                drip.settimeout(0.5)
                if drip.recv(1) == b"":
                    closed = time.monotonic() - began
            except TimeoutError:
                continue
            except OSError:
                closed = time.monotonic() - began
        assert closed is not None and closed < 4.0, (
            closed
        )  # the head's deadline (2 s here), not per byte
        for sock in held:
            sock.close()
    finally:
        server.kill()
        server.wait()
