"""``kvflow bridge``: real engines (vLLM, SGLang, TensorRT-LLM) as kvflow nodes (docs/bridges.md)."""
