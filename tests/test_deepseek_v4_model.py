"""DeepSeek-V4 as a whole, in one process, against transformers' DeepseekV4ForCausalLM.

A random small V4 with all three attention kinds (sliding, compressed sparse, heavily
compressed), hash-routed and top-k routed experts, 4 hyper-connection streams, a window and
compression rates that a 13-token prompt crosses: the logits of the prompt at once, in chunks
through the caches, and decoded a token at a time, each within 1e-4 of the reference's."""

from __future__ import annotations

import pytest
import torch

from seamline.model.v4_model import V4Model, load_reference_weights

PROMPT = 13


@pytest.fixture(scope="module")
def pair():  # type: ignore[no-untyped-def]
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, head_dim=16,
                              q_lora_rank=16, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                              hc_mult=4, sliding_window=4, partial_rotary_factor=0.5, o_groups=2, o_lora_rank=8,
                              index_n_heads=4, index_head_dim=8, index_topk=2,
                              layer_types=["sliding_attention", "compressed_sparse_attention",
                                           "heavily_compressed_attention"],
                              mlp_layer_types=["hash_moe", "moe", "moe"],
                              compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 3})  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    reference = DeepseekV4ForCausalLM(config).float().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, tensor in reference.state_dict().items():  # beyond the init: biases, sinks, tables too
            if name.endswith("tid2eid"):
                tensor.copy_(torch.randint(0, config.n_routed_experts, tensor.shape, generator=generator))
            elif tensor.is_floating_point():
                scale = 1.0 if tensor.dim() == 1 else 0.2
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * scale)
    ours = V4Model(config.to_dict())
    load_reference_weights(ours, reference.state_dict())
    return reference, ours


def _reference_logits(reference, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return reference(ids.unsqueeze(0), use_cache=False).logits[0]


def test_v4_logits_equal_the_reference_at_once_in_chunks_and_decoding(pair) -> None:  # type: ignore[no-untyped-def]
    reference, ours = pair
    ids = torch.randint(0, 96, (PROMPT,), generator=torch.Generator().manual_seed(2))
    expected = _reference_logits(reference, ids)
    assert expected.abs().max() > 1.0  # logits with a spread worth comparing
    torch.testing.assert_close(ours(ids, 0, ours.new_caches()), expected, rtol=0, atol=1e-4)
    caches = ours.new_caches()
    rows = [ours(ids[:5], 0, caches), ours(ids[5:9], 5, caches)]
    rows += [ours(ids[p : p + 1], p, caches) for p in range(9, PROMPT)]
    torch.testing.assert_close(torch.cat(rows), expected, rtol=0, atol=1e-4)


def test_two_stages_passing_the_residual_and_the_ids_equal_the_whole(pair) -> None:  # type: ignore[no-untyped-def]
    """Layers [0, 2) and [2, 3) as two stages, each loaded with its own part only: the first's
    output is the residual [T, 4, 32]; with the ids, the second's logits equal the whole's,
    at once and decoding."""
    from seamline.model.v4_model import boundary_bytes

    reference, whole = pair
    config = reference.config.to_dict()
    first, second = V4Model(config, (0, 2)), V4Model(config, (2, 3))
    for stage in (first, second):
        load_reference_weights(stage, reference.state_dict())
    assert first.head is None and second.embed is None and len(second.layers) == 1
    ids = torch.randint(0, 96, (PROMPT,), generator=torch.Generator().manual_seed(3))
    expected = whole(ids, 0, whole.new_caches())
    caches = (first.new_caches(), second.new_caches())
    residual = first(ids[:9], 0, caches[0])
    assert residual.shape == (9, 4, 32)
    rows = [second(ids[:9], 0, caches[1], residual)]
    for p in range(9, PROMPT):
        rows.append(second(ids[p : p + 1], p, caches[1], first(ids[p : p + 1], p, caches[0])))
    torch.testing.assert_close(torch.cat(rows), expected, rtol=0, atol=1e-5)
    assert boundary_bytes(config, torch.bfloat16) == 4 * 32 * 2 + 8
    with pytest.raises(ValueError, match="need the residual"):
        second(ids[:2], 0, second.new_caches())


def test_a_missing_indexer_tensor_or_a_hash_table_of_the_wrong_size_is_named(pair) -> None:  # type: ignore[no-untyped-def]
    from seamline.errors import CheckpointError

    reference, _ = pair
    config, state = reference.config.to_dict(), dict(reference.state_dict())
    without = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"}
    with pytest.raises(CheckpointError, match=r"no tensor for layers\.1\.attn\.indexer\.q_b"):
        load_reference_weights(V4Model(config), without)
    wrong = {**state, "model.layers.0.mlp.gate.tid2eid": torch.zeros(95, 2, dtype=torch.long)}
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.gate\.tid2eid has shape \(95, 2\); the config needs \(96, 2\)"):
        load_reference_weights(V4Model(config), wrong)


def test_32_greedy_tokens_decoded_through_the_caches_equal_the_reference(pair) -> None:  # type: ignore[no-untyped-def]
    """Ours decodes through its caches a token at a time; the reference's token at each step is
    the argmax of its logits over the whole sequence so far, computed afresh (no cache)."""
    reference, ours = pair
    ids = torch.randint(0, 96, (PROMPT,), generator=torch.Generator().manual_seed(4))
    caches = ours.new_caches()
    token = int(ours(ids, 0, caches)[-1].argmax())
    mine, sequence = [token], ids.tolist() + [token]
    for _ in range(31):
        token = int(ours(torch.tensor([token]), len(sequence) - 1, caches)[-1].argmax())
        mine.append(token)
        sequence.append(token)
    theirs, sequence = [], ids.tolist()
    for _ in range(32):
        theirs.append(int(_reference_logits(reference, torch.tensor(sequence))[-1].argmax()))
        sequence.append(theirs[-1])
    assert mine == theirs
