"""routing_api: KV-aware request routing over the materialized cache state (FastAPI)."""
