-- kvflow's database and its two roles (DESIGN.md, "PostgreSQL"). Run by a superuser with psql:
--   psql -v owner_password=… -v reader_password=… -f roles.sql
-- Idempotent: run it again to rotate passwords. Used by `kvflow stack up` (local cluster) and by
-- the compose stack (deploy/postgres/init-roles.sh). The owner role owns the schema and writes
-- (migrations, materializer); the reader role can only read (routing API, analysts). Neither is
-- a superuser.
\set ON_ERROR_STOP on

SELECT 'CREATE ROLE kvflow LOGIN' WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvflow')
\gexec
SELECT 'CREATE ROLE kvflow_reader LOGIN' WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kvflow_reader')
\gexec
SELECT format('ALTER ROLE kvflow WITH LOGIN NOSUPERUSER PASSWORD %L', :'owner_password')
\gexec
SELECT format('ALTER ROLE kvflow_reader WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD %L', :'reader_password')
\gexec
-- Every session of the reader is read-only, whatever it asks for.
ALTER ROLE kvflow_reader SET default_transaction_read_only = on;

SELECT 'CREATE DATABASE kvflow OWNER kvflow' WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = 'kvflow')
\gexec
ALTER DATABASE kvflow OWNER TO kvflow;
REVOKE ALL ON DATABASE kvflow FROM PUBLIC;
GRANT CONNECT, TEMPORARY ON DATABASE kvflow TO kvflow;
GRANT CONNECT ON DATABASE kvflow TO kvflow_reader;

\connect kvflow
ALTER SCHEMA public OWNER TO kvflow;
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO kvflow_reader;
-- Tables that the owner creates later (migrations, new partitions) are readable by the reader.
ALTER DEFAULT PRIVILEGES FOR ROLE kvflow IN SCHEMA public GRANT SELECT ON TABLES TO kvflow_reader;
GRANT SELECT ON ALL TABLES IN SCHEMA public TO kvflow_reader;
