"""Where a model comes from (a Hugging Face folder, a GGUF file, an OpenVINO export) and its tokenizer."""
