"""Checkpoint readers: Hugging Face folders and GGUF files, behind one TensorSource."""
