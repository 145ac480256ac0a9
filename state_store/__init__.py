"""State store: kvflow's PostgreSQL schema (models), sessions, queries and the materializer."""
