"""The thread that generates holds its process's only OpenMP pool (``runtime/openmp.py``).

A decode step is a few hundred OpenMP regions; with more pooled threads than cores libgomp
puts every worker to sleep between them, and each step then wakes them a few hundred times.
That is counted here, not timed: the voluntary context switches of the serving process per
generated token (a sleeping worker makes one per region, a spinning one none).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from seamline.runtime.openmp import on_passing_thread
from seamline.server.demo import memory_cap_gb
from tests.support.mesh_harness import MeshProcesses

# ``serve --single``'s backend in a fresh process, 64 tokens generated on the batch loop's thread
SERVED = """
import json, os, threading
import torch
from seamline.params import SamplingParams
from seamline.server import serve_local

torch.set_num_threads(2)  # a pool of two: a worker beside the thread that starts each region
if {direct}:
    serve_local.on_passing_thread = lambda work: work()  # as it was: loaded on this (the main) thread
backend, _ = serve_local.local_backend(None, "float32")

def switches():
    total = 0
    for task in os.listdir("/proc/self/task"):
        status = open(f"/proc/self/task/{{task}}/status").read()
        total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return total

def generate(count):
    done, tokens = threading.Event(), []
    def deliver(event):  # the last event carries the finish reason
        tokens.append(event)
        if event.finish_reason is not None:
            done.set()
    backend.loop.submit([1, 2, 3, 4], SamplingParams(max_tokens=count), deliver)
    done.wait()
    return len(tokens)

generate(4)
before = switches()
count = generate(64)
print(json.dumps({{"per_token": (switches() - before) / count}}), flush=True)
os._exit(0)  # not Python's finalisation, which ends the daemon batch thread wherever it is
"""


def _switches_per_token(direct: bool) -> float:
    proc = subprocess.run(
        [sys.executable, "-c", SERVED.format(direct=direct)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["per_token"])


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="counts context switches in /proc (Linux)"
)
def test_served_model_generates_with_spinning_workers() -> None:
    loaded_here = _switches_per_token(direct=True)
    served = _switches_per_token(direct=False)
    assert loaded_here > 100, (
        f"the premise: a model loaded on another thread sleeps its workers ({loaded_here:.0f})"
    )
    assert served < 50, (
        f"{served:.0f} voluntary context switches per token: OpenMP workers sleep between regions"
    )


def _process_switches(pid: int) -> int:
    """Voluntary context switches of every thread of process ``pid``."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        status = (task / "status").read_text()
        total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="counts context switches in /proc (Linux)"
)
def test_mesh_nodes_generate_with_spinning_workers(tmp_path: Path) -> None:
    """A node measures its speed as it joins, loads its stage and answers probes on threads of
    its own, and computes on another: only the computing thread's pool may last. A few
    switches per token are the links' (a read that waits); a sleeping pool makes hundreds."""
    mesh = MeshProcesses(
        tmp_path,
        nodes=2,
        node_memory_gb=memory_cap_gb(None, 2, 1024, dtype_bytes=2),
        serve_args=("--context", "1024", "--precision", "fast"),
    )
    mesh.start()
    try:
        mesh.wait_ready()
        client = mesh.client()

        def generate(count: int) -> int:
            reply = client.completions.create(
                model="default",
                prompt="Once upon a time",
                max_tokens=count,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert reply.usage is not None
            return reply.usage.completion_tokens

        generate(4)
        before = [_process_switches(proc.pid) for proc in mesh.node_procs]
        count = generate(64)
        after = [_process_switches(proc.pid) for proc in mesh.node_procs]
        per_token = [(a - b) / count for a, b in zip(after, before, strict=True)]
        assert count == 64
        assert max(per_token) < 50, (
            f"{per_token} voluntary context switches per token: OpenMP workers sleep"
        )
    finally:
        mesh.stop()


def test_passing_thread_returns_and_raises() -> None:
    assert on_passing_thread(lambda: 41 + 1) == 42

    def fails() -> None:
        raise ValueError("from the passing thread")

    with pytest.raises(ValueError, match="from the passing thread"):
        on_passing_thread(fails)
