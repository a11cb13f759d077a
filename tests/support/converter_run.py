"""Runs llama.cpp's converter on several jobs in one process (its imports are most of its time):
``python converter_run.py SOURCE``, then one job a line on stdin as it is ready, each
``{"argv": [...], "pre": name | null}``. Run on the converter's own gguf-py (``PYTHONPATH``);
imports nothing of seamline.

``pre``: the pre-tokenizer name to write when the converter does not recognise the tokenizer's
hash (a test checkpoint's tokenizer under a family's own tokenizer class); unset, it fails."""

from __future__ import annotations

import json
import sys
from typing import Any


def main() -> None:
    sys.path.insert(0, sys.argv[1])
    import convert_hf_to_gguf
    from conversion.base import TextModel

    recognise = TextModel.get_vocab_base_pre
    for line in sys.stdin:
        job = json.loads(line)

        def pre(self: Any, tokenizer: Any, fallback: str | None = job["pre"]) -> str:
            try:
                return recognise(self, tokenizer)
            except NotImplementedError:
                if fallback is None:
                    raise
                return fallback

        TextModel.get_vocab_base_pre = pre  # type: ignore[method-assign]
        sys.argv = ["convert_hf_to_gguf.py", *job["argv"]]
        convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
