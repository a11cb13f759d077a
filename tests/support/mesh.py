"""A mesh of real processes for a test, and what it answers."""

from __future__ import annotations

from pathlib import Path

import httpx

from seamline.app import LocalModel
from seamline.params import SamplingParams
from seamline.server.demo import memory_cap_gb
from tests.support.mesh_harness import MeshProcesses

CONTEXT = 1024

QUESTION = "Name three rivers in Europe and one fact about each."


def expected_text(model: LocalModel, question: str, tokens: int) -> str:
    ids = model.codec.encode_chat([{"role": "user", "content": question}])
    params = SamplingParams(max_tokens=tokens, stop_token_ids=model.codec.stop_ids)
    return model.codec.decode(list(model.engine.generate(ids, params)))


def expected_forked_text(model: LocalModel, question: str, tokens: int) -> str:
    """The greedy answer of a request that arrives while the same prompt is running: the
    scheduler copies the running sequence's cache of every prompt position but the last
    (``SequenceCache.fork``) and computes that one as a one-row step, whose sums in the fast
    precision (bfloat16 activations, int8 blocks) may part from the whole prompt's at a near tie."""
    import torch

    ids = model.codec.encode_chat([{"role": "user", "content": question}])
    stage = model.engine.stage
    with torch.inference_mode():
        first = stage.new_cache()
        stage(torch.tensor(ids), 0, first, last_only=True)
        cache, out, token, position = first.fork(len(ids) - 1), [], ids[-1], len(ids) - 1
        for _ in range(tokens):
            token = int(
                stage(torch.tensor([token]), position, cache, last_only=True)[-1].float().argmax()
            )
            if token in model.codec.stop_ids:
                break
            out.append(token)
            position += 1
    return model.codec.decode(out)


def ask(mesh: MeshProcesses, question: str, tokens: int) -> dict:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": tokens,
    }
    reply = httpx.post(f"{mesh.base_url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def start_mesh(
    root: Path,
    stages: int,
    *serve_args: str,
    cap_within: float = 0.5,
    model: Path | None = None,
    context: int = CONTEXT,
) -> MeshProcesses:
    """``cap_within``: where in the range of per-node memory caps that need ``stages`` stages
    (``memory_cap_gb``); lower keeps each stage nearer its even share of the layers. ``model``:
    a checkpoint folder (None: the embedded model)."""
    name = str(model) if model is not None else None
    cap = memory_cap_gb(name, stages, context, within=cap_within, mtp=_drafts_with_mtp(serve_args))
    mesh = MeshProcesses(
        root,
        nodes=stages,
        node_memory_gb=cap,
        model=name,
        serve_args=("--context", str(context), *serve_args),
    )
    return mesh.start()


def _drafts_with_mtp(serve_args: tuple[str, ...]) -> bool:
    """Whether ``serve_args`` leave ``--speculative`` auto or mtp (a checkpoint's MTP layer drafts)."""
    args = list(serve_args)
    return "--speculative" not in args or args[args.index("--speculative") + 1] in ("auto", "mtp")


def assert_join_refused(mesh: MeshProcesses, token: str, fragment: str) -> None:
    proc = mesh.join(f"bad{len(mesh.node_procs)}", token=token)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert fragment in stderr and "Traceback" not in stderr, stderr


SPECULATION_LIST = [
    {
        "role": "user",
        "content": "Repeat this list exactly, twice: apples, pears, plums, cherries, figs, dates.",
    }
]
SPECULATION_ASKS = [
    {"temperature": 0},
    {"temperature": 0.8, "top_p": 0.9, "seed": 3},
    {"temperature": 0, "frequency_penalty": 1.0, "presence_penalty": 0.5},
]


def speculation_answers(
    root: Path, *serve_args: str, stages: int = 2, model: Path | None = None, context: int = CONTEXT
) -> tuple[list[str], dict[str, float]]:
    """A mesh's answers of 64 tokens to the list (greedy, seeded, with penalties) and stage 0's
    speculation counts from /api/status (empty where it drafted nothing)."""
    mesh = start_mesh(root, stages, *serve_args, model=model, context=context)
    try:
        assert len(mesh.wait_ready()["stages"]) == stages
        answers = []
        for ask_ in SPECULATION_ASKS:
            body = {
                "model": "default",
                "messages": SPECULATION_LIST,
                "max_tokens": 64,
                "ignore_eos": True,
                **ask_,
            }
            reply = httpx.post(
                f"{mesh.base_url}/v1/chat/completions", json=body, timeout=120
            ).json()
            assert reply["usage"]["completion_tokens"] == 64, reply
            answers.append(reply["choices"][0]["message"]["content"])
        status = httpx.get(f"{mesh.base_url}/api/status", timeout=30).json()
    finally:
        mesh.stop()
    return answers, status["stages"][0].get("speculation") or {}
