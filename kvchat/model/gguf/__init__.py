"""llama.cpp's GGUF files: reading them, dequantizing their blocks, translating their
config and tensor names to Hugging Face's, rebuilding their tokenizer, and keeping their
4-bit matrices 4-bit."""
