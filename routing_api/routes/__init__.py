"""The router's endpoints, one ``APIRouter`` per concern; ``routing_api.app`` includes them in order.

Routes only parse, query and format: the decision is ``routing_api.decisions`` (pure at its core,
``routing_api.scoring``), the SQL is ``routing_api.queries``, the JSON shapes ``routing_api.schemas``.

NOTE: the endpoint functions have no docstrings, and keep their names: FastAPI publishes a
docstring as the operation's description and derives operation ids and response titles from the
name, and the OpenAPI document is part of the contract (clients and the fuzz tests use it).
"""
