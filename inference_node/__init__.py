"""inference_node: the paged KV cache core (kv/), the torch model, engine, server and publisher."""
