"""A random Mixture-of-Experts checkpoint split over a 2-node mesh equals the single process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seamline.app import LocalModel, default_model_path
from seamline.mesh.protocol.invite import Invite
from seamline.mesh.node.process import Node, NodeOptions
from seamline.net.messages import Assign
from seamline.params import SamplingParams
from seamline.weights.gguf import chat_template_from_gguf, tokenizer_from_gguf
from tests.mesh_harness import split_completion
from tests.reference import save_random_model

CONTEXT = 512
PROMPT = "The rivers of Europe include"


def build_moe_folder(folder: Path) -> Path:
    """A tiny random Mixtral with the embedded model's tokenizer (so text round-trips)."""
    from transformers import MixtralConfig

    tokenizer = tokenizer_from_gguf(default_model_path())
    config = MixtralConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=96,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=CONTEXT,
                           tie_word_embeddings=False)  # fmt: skip
    save_random_model(config, folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    template = chat_template_from_gguf(default_model_path())
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder


def test_moe_mesh_matches_single_process(tmp_path: Path) -> None:
    folder = build_moe_folder(tmp_path / "moe")
    local = LocalModel.load(folder, context=CONTEXT)
    ids = local.codec.encode(PROMPT)
    expected = local.codec.decode(list(local.engine.generate(ids, SamplingParams(max_tokens=24))))
    assert split_completion(tmp_path / "mesh", folder, PROMPT, 24, CONTEXT) == expected


def test_a_node_refuses_an_assignment_it_cannot_hold() -> None:
    node = Node(Invite(("127.0.0.1",), 1, 2, "s", 0.0), NodeOptions(max_memory_bytes=1 << 30))
    assign = Assign(plan_id=1, model_hash="h", fragments_url="http://x", layers=(0, 4), owns_embedding=True,
                    owns_head=False, dtype="float32", context_length=512, memory_bytes=3 << 30)  # fmt: skip
    with pytest.raises(MemoryError, match=r"cannot hold layers \[0,4\): they need 3.00 GiB, this node has 1.00 GiB"):
        node._check_room(assign)
