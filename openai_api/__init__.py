"""openai_api: OpenAI's HTTP surface as kvflow speaks it, shared by the node, the router and the bridge.

The request and response bodies (``schemas``: completions, chat, what a node cannot honour, what
the router reads to route), chat templates rendered as transformers renders them (``chat``), the
tokenizers node and router share (``tokenizers``) and the request body limit (``http``). It
imports only the wire (``eventbus``) among kvflow's packages, and never torch.
"""
