#!/bin/sh
# Compose: the postgres image runs this once, on an empty volume, as its superuser.
# Passwords come from the environment (docker-compose.yml requires them), never from this file.
set -eu
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v owner_password="$KVFLOW_DB_PASSWORD" \
  -v reader_password="$KVFLOW_DB_READER_PASSWORD" \
  -f /docker-entrypoint-initdb.d/roles.sql.in
