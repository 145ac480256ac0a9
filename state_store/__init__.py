"""State store: kvflow's PostgreSQL schema (models), its SQL, the planner, the pipeline and the materializer."""
