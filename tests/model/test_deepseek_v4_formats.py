"""DeepSeek-V4 in its own formats: fp8 block-scaled weights and fp4 experts, kept at their size
in memory and equal to transformers' dequantisation; the original checkpoint's names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from seamline.params import SamplingParams
from seamline.quant.scaled import ScaledTensor
from seamline.runtime.engine import Engine
from seamline.weights.loader import load_stage, open_source
from seamline.weights.packaging import package
from tests.support.lockstep_harness import (
    engine_reference,
    generate_recording,
    running_group,
)
from tests.support.v4_formats import dequantized_by_transformers, quantize_folder
from tests.support.v4_reference import reference_logits, save_random_v4, v4_config

IDS = torch.tensor([1, 5, 9, 13, 2, 7, 3, 11, 40, 41, 17, 60, 88, 4])


@pytest.fixture(scope="module")
def formats(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("v4-formats")
    reference = save_random_v4(root / "float", v4_config(hidden_size=64, moe_intermediate_size=32))
    quantized = quantize_folder(root / "float", root / "v4")
    dequantized = dequantized_by_transformers(quantized)
    reference.load_state_dict(_merged(reference.state_dict(), dequantized))
    return root / "v4", reference, quantized, dequantized


def _merged(state: dict, dequantized: dict) -> dict:  # type: ignore[type-arg]
    """transformers' state dict with the dequantised weights in its layout (experts fused,
    shared experts and attention renamed), as its own loader would put them."""
    merged = dict(state)
    renames = {
        ".attn.wq_a.": ".self_attn.q_a_proj.",
        ".attn.wq_b.": ".self_attn.q_b_proj.",
        ".attn.wkv.": ".self_attn.kv_proj.",
        ".attn.wo_a.": ".self_attn.o_a_proj.",
        ".attn.wo_b.": ".self_attn.o_b_proj.",
        ".ffn.shared_experts.w1.": ".mlp.shared_experts.gate_proj.",
        ".ffn.shared_experts.w2.": ".mlp.shared_experts.down_proj.",
        ".ffn.shared_experts.w3.": ".mlp.shared_experts.up_proj.",
    }
    experts: dict[tuple[str, int, str], torch.Tensor] = {}
    for name, value in dequantized.items():
        if ".ffn.experts." in name:
            prefix, rest = name.split(".ffn.experts.")
            index, which = rest.split(".")[:2]
            experts[(prefix, int(index), which)] = value
            continue
        for theirs, ours in renames.items():
            name = name.replace(theirs, ours)
        assert name in merged, name
        merged[name] = value
    for prefix in {p for p, _, _ in experts}:
        count = max(i for p, i, _ in experts if p == prefix) + 1
        gate_up = torch.stack(
            [
                torch.cat([experts[(prefix, e, "w1")], experts[(prefix, e, "w3")]])
                for e in range(count)
            ]
        )
        merged[f"{prefix}.mlp.experts.gate_up_proj"] = gate_up
        merged[f"{prefix}.mlp.experts.down_proj"] = torch.stack(
            [experts[(prefix, e, "w2")] for e in range(count)]
        )
    return merged


def test_scaled_weights_dequantise_as_transformers_does(formats) -> None:  # type: ignore[no-untyped-def]
    _, _, quantized, dequantized = formats
    kinds = set()
    for name, (values, scales) in quantized.items():
        kind = "fp8" if values.dtype == torch.float8_e4m3fn else "fp4"
        kinds.add(kind)
        ours = ScaledTensor(kind, values, scales.float())
        assert torch.equal(ours.dequantize(torch.float32), dequantized[name]), name
    assert kinds == {"fp8", "fp4"}


def test_v4_in_its_formats_equals_the_reference_and_stays_at_its_size(formats) -> None:  # type: ignore[no-untyped-def]
    folder, reference, _, _ = formats
    stage = load_stage(open_source(folder))
    experts = stage.layers["1"].ffn.experts_gate_up  # type: ignore[union-attr]
    assert (
        isinstance(experts, ScaledTensor)
        and experts.kind == "fp4"
        and experts.values.dtype == torch.int8
    )
    assert (
        experts.nbytes == 4 * 2 * 32 * 64 // 2 + 4 * 2 * 32 * 64 // 32 * 4
    )  # half a byte a weight + scales
    attention = stage.layers["1"].attn.q_b  # type: ignore[union-attr]
    assert (
        isinstance(attention, ScaledTensor)
        and attention.kind == "fp8"
        and attention.block == (8, 8)
    )
    expected = reference_logits(reference, IDS)
    torch.testing.assert_close(stage(IDS, 0, stage.new_cache()), expected, rtol=0, atol=1e-4)
    mine = list(Engine(stage).generate(IDS.tolist(), SamplingParams(max_tokens=16)))
    theirs, sequence = [], IDS.tolist()
    for _ in range(16):
        theirs.append(int(reference_logits(reference, torch.tensor(sequence))[-1].argmax()))
        sequence.append(theirs[-1])
    assert mine == theirs


def test_fragments_and_lockstep_groups_keep_the_formats(formats, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Packaged into fragments, the scaled weights come back as they were; a 2-rank lockstep
    group (real processes) on the fragments, each rank holding whole fp8 output groups and
    half the fp4 experts, gives the single process's tokens and logits."""
    folder, reference, _, _ = formats
    package(folder, tmp_path / "pkg", progress=False)
    source = open_source(tmp_path / "pkg")
    assert source.stored_type("model.layers.1.ffn.experts.0.w1.weight") == "float4_e2m1"
    assert source.stored_type("model.layers.1.attn.wq_b.weight") == "float8_e4m3"
    whole = load_stage(source)
    torch.testing.assert_close(
        whole(IDS, 0, whole.new_cache()), reference_logits(reference, IDS), rtol=0, atol=1e-4
    )
    ref = engine_reference(Engine(whole), IDS.tolist(), steps=12)
    with running_group(tmp_path / "pkg", 2) as group:
        attn = group.leader.stage.layers["1"].attn  # type: ignore[union-attr]
        assert isinstance(attn.o_b, ScaledTensor) and attn.q_b.shape == (
            32,
            16,
        )  # 2 of 4 heads of 16
        group.greedy_exchange = False
        tokens, logits = generate_recording(group, IDS.tolist(), SamplingParams(max_tokens=12))
    assert tokens == ref.tokens
    assert (logits - ref.logits[: len(logits)]).abs().max().item() < 1e-4


def test_a_bad_scale_is_named(formats, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A scale that is not finite, or a scale grid that does not divide its weight: one line
    naming the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    from seamline.errors import CheckpointError

    folder = formats[0]
    for case, change in (
        ("corrupt: block 0 has an infinite or NaN scale", lambda s: s.float().fill_(float("inf"))),
        ("scale grid \\(5, 2\\) does not divide", lambda s: s.float()[:5]),
    ):
        bad = tmp_path / case[:7]
        shutil.copytree(folder, bad)
        state = load_file(str(bad / "model.safetensors"))
        state["layers.1.attn.wq_b.scale"] = change(state["layers.1.attn.wq_b.scale"]).contiguous()
        save_file(state, str(bad / "model.safetensors"))
        with pytest.raises(
            CheckpointError, match=f"model.layers.1.attn.wq_b.weight.*{case}|{case}"
        ):
            load_stage(open_source(bad))
