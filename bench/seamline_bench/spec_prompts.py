"""The prompts ``seamline bench spec`` streams: fixed here, printed in its JSON.

``edit`` asks for a whole function back with one name changed (most of the answer is in the
prompt: the case speculation is for); ``quote`` asks for a passage back with its typos fixed;
``open`` asks for a story (little to copy: speculation must not cost it speed).
"""

from __future__ import annotations

EDIT_FUNCTION = """def parse_config(path):
    settings = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            key = key.strip().lower()
            value = value.strip()
            if value.isdigit():
                value = int(value)
            elif value.lower() in ("true", "false"):
                value = value.lower() == "true"
            settings[key] = value
    if "name" not in settings:
        raise ValueError("the config has no name")
    if "port" in settings and not 0 < settings["port"] < 65536:
        raise ValueError("the port is out of range")
    return settings
"""

QUOTE_PASSAGE = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in long strips. "
    "Every evening the keeper climbed the one hundred and twelve steps to light the lamp, and every "
    "morning he climbed them again to put it out. The ships that passed never knew his name, but "
    "they trusted his light more then they trusted their own charts. One winter a storm broke the "
    "great lens, and for three nights the keeper kept a fire burning on the gallery insted, feeding "
    "it with driftwood and the legs of his own chairs. When the supply boat finally came, the "
    "captain found him asleep beside the ashes, and the sea below was calm and empty and safe."
)

WORKLOADS: dict[str, str] = {
    "edit": "```python\n"
    + EDIT_FUNCTION
    + "```\n\nRename the variable `settings` to `options` and return the whole function.",
    "quote": "Repeat this passage exactly, fixing only its two spelling mistakes:\n\n"
    + QUOTE_PASSAGE,
    "open": "Write a short story about a fox and a crow who argue about who owns a piece of cheese.",
}
