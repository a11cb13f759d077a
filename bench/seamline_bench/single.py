"""`seamline bench single`: seamline's engine against transformers on the embedded model.

Both run greedy batch-1 decode of the same prompt ids in the same process, alternating,
several repeats; medians are reported. transformers loads the same GGUF (dequantised to the
same float32 weights). Also: 512-token prefill rate for both, and the peak resident memory
of a separate `seamline run` process.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from seamline.app import LocalModel
from seamline.params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PREFILL_TOKENS = 512


def bench_single(repeats: int = 3, tokens: int = 128) -> dict[str, Any]:
    model = LocalModel.load()
    reference = _load_transformers(model)
    prompt = model.codec.encode_chat([{"role": "user", "content": PROMPT}])
    params = SamplingParams(max_tokens=tokens)  # no stop tokens: always `tokens` tokens
    ours, theirs, our_prefill, their_prefill = [], [], [], []
    long_prompt = (prompt * (PREFILL_TOKENS // len(prompt) + 1))[:PREFILL_TOKENS]
    _decode_ours(model, prompt, params)  # warm-up both
    _decode_theirs(reference, prompt, 8)
    for _ in range(repeats):
        ours.append(_decode_ours(model, prompt, params))
        theirs.append(_decode_theirs(reference, prompt, tokens))
        our_prefill.append(_prefill_ours(model, long_prompt))
        their_prefill.append(_prefill_theirs(reference, long_prompt))
    seamline_tok_s, transformers_tok_s = statistics.median(ours), statistics.median(theirs)
    return {
        "bench": "single",
        "model": model.path.name,
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "tokens": tokens,
        "repeats": repeats,
        "seamline_tok_s": round(seamline_tok_s, 2),
        "transformers_tok_s": round(transformers_tok_s, 2),
        "ratio": round(seamline_tok_s / transformers_tok_s, 3),
        "seamline_runs_tok_s": [round(x, 2) for x in ours],
        "transformers_runs_tok_s": [round(x, 2) for x in theirs],
        "prefill_tok_s": {
            "seamline": round(statistics.median(our_prefill), 1),
            "transformers": round(statistics.median(their_prefill), 1),
            "prompt_tokens": PREFILL_TOKENS,
        },
        "peak_rss_mb_seamline_run": _peak_rss_of_run(),
    }


def _load_transformers(model: LocalModel) -> Any:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise SystemExit("bench single needs transformers: ./install.sh --test") from None
    path = model.path
    ref = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    ref.generation_config.eos_token_id = None  # always generate the full count, as seamline does
    return ref.eval()


def _decode_ours(model: LocalModel, prompt: list[int], params: SamplingParams) -> float:
    engine = model.engine
    cache = engine.stage.new_cache()
    logits = engine.prefill(prompt, cache)
    token, position = int(torch.argmax(logits)), len(prompt)
    start = time.perf_counter()
    for _ in range(params.max_tokens):
        logits = engine.stage(torch.tensor([token]), position, cache)[-1]
        token, position = int(torch.argmax(logits)), position + 1
    return params.max_tokens / (time.perf_counter() - start)


def _decode_theirs(reference: Any, prompt: list[int], tokens: int) -> float:
    """Decode rate of transformers' generate, excluding its prefill (timed separately)."""
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)  # explicit: the prompt holds pad-id tokens (<|im_end|>)
    with torch.inference_mode():
        start = time.perf_counter()
        reference.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        reference.generate(ids, attention_mask=mask, max_new_tokens=tokens + 1, do_sample=False)
        total = time.perf_counter() - start
    return tokens / max(total - prefill, 1e-9)


def _prefill_ours(model: LocalModel, prompt: list[int]) -> float:
    start = time.perf_counter()
    model.engine.prefill(prompt, model.engine.stage.new_cache())
    return len(prompt) / (time.perf_counter() - start)


def _prefill_theirs(reference: Any, prompt: list[int]) -> float:
    with torch.inference_mode():
        start = time.perf_counter()
        reference(torch.tensor([prompt]), logits_to_keep=1)
        return len(prompt) / (time.perf_counter() - start)


def _peak_rss_of_run() -> float:
    """Peak resident memory (MB) of a separate `seamline run` process.

    Read as the kernel's VmHWM of the child (its own address space's high-water mark);
    ``ru_maxrss`` would not do: it is carried across exec from this large parent.
    """
    args = [
        sys.executable,
        "-m",
        "seamline.cli",
        "run",
        "-p",
        "What is the capital of France?",
        "--max-tokens",
        "16",
        "--speculative",
        "off",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    peak_kb = 0
    status = f"/proc/{proc.pid}/status"
    while proc.poll() is None:
        try:
            with open(status) as f:
                line = next((line for line in f if line.startswith("VmHWM:")), "VmHWM: 0 kB")
            peak_kb = max(peak_kb, int(line.split()[1]))
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    if proc.returncode != 0:
        raise RuntimeError(f"seamline run exited with status {proc.returncode}")
    return round(peak_kb / 1024, 1)
