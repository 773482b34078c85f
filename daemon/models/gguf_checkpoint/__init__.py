"""GGUF checkpoints (llama.cpp's single-file format): config, weights and tokenizer from its
metadata and tensors, read with the `gguf` package."""
