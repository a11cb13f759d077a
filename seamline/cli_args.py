"""The arguments several commands share: the model, its precision and device, speculation,
sampling and lockstep groups. ``cli`` calls these on its parsers; only ``cli`` parses argv."""

from __future__ import annotations

import argparse


def tensor_parallel_arg(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--tensor-parallel N``, spelt as vLLM spells it too (``--tensor-parallel-size``, ``-tp``)."""
    parser.add_argument(
        "--tensor-parallel",
        "--tensor-parallel-size",
        "-tp",
        dest="tensor_parallel",
        type=int,
        default=0,
        metavar="N",
        help=help_text,
    )


def precision_args(p: argparse.ArgumentParser) -> None:
    from seamline.precision import FLOAT_NAMES, PRECISIONS

    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fast",
        help="fast: quantized weights with bfloat16 activations and int8 blocks in the matmuls, as "
        "llama.cpp; exact: float32, the dequantised model's answers (default: fast)",
    )
    p.add_argument(
        "--dtype",
        choices=FLOAT_NAMES,
        default=None,
        help="activation dtype, overriding the precision's (fast: bfloat16 for quantized weights, "
        "else the weights' own; exact: float32)",
    )


def speculation_args(p: argparse.ArgumentParser) -> None:
    from seamline.runtime.speculation import DRAFT_MAX, MODES

    p.add_argument(
        "--speculative",
        choices=MODES,
        default="auto",
        help="draft tokens and verify them in the decode step: the output is the same, sooner when "
        "drafts are right (auto: what the model offers: DeepSeek-V3's multi-token-prediction layer where "
        "the checkpoint has it and one process serves, else n-grams of the prompt and answer)",
    )
    p.add_argument(
        "--draft-max", type=int, default=DRAFT_MAX, help="the most tokens one window drafts"
    )
    p.add_argument(
        "--draft-model",
        metavar="PATH",
        default=None,
        help="a smaller model with the same vocabulary drafts (one process: run, serve --single)",
    )
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        default=None,
        help='as vLLM takes it: {"method": "ngram"|"mtp"|"deepseek_mtp", "num_speculative_tokens": N} '
        'or {"model": PATH, ...}, in place of --speculative, --draft-max and --draft-model',
    )


def device_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--device",
        default="auto",
        help="where the model computes: auto (CUDA when torch sees it, else the CPU), cpu, cuda, cuda:N, mps",
    )


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face folder or .gguf file (default: embedded SmolLM2)")
    precision_args(p)
    device_arg(p)
    speculation_args(p)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--context", type=int, default=0, help="context length (0: the model's own)")


def sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
