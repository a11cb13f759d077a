"""The real Gemma 3 270M GGUF's raw answer to one prompt, as llama-server and transformers give it."""

PROMPT = "The capital of France is"
PROMPT_IDS = [2, 818, 5279, 529, 7001, 563]  # BOS, then the text's ids
# the first 15 tokens are llama-server's answer on this file (its 16th, " and", is a near tie:
# 0.08 behind in llama.cpp's logits); all 16 are transformers' on the dequantised weights
# (float32), as seamline computes at --precision exact
ANSWER = " the capital of the country of France. It is the largest city in France and"
