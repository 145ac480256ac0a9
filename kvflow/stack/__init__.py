"""The local development stack: a real Apache Kafka broker (KRaft) and a private PostgreSQL.

No Docker: Kafka's jars are resolved from Maven Central through ``deploy/kafka/pom.xml`` (once,
then cached), its storage is formatted with Kafka's own ``StorageTool`` and the broker runs with
``java``; PostgreSQL is a cluster created with the installed server binaries (``initdb``) in a
git-ignored folder, on its own port. ``KVFLOW_DATABASE_URL`` names an existing server instead.

Everything the stack writes lives under one state folder (``.kvflow/`` in the project, or
``KVFLOW_STACK_HOME``): jars, data, logs (``logs/``) and the pid files through which ``down``
stops exactly what ``up`` started. ``up`` is idempotent.

One module per component: ``settings`` (settings, errors, paths), ``procs`` (process helpers),
``kafka`` (one KRaft node), ``cluster`` (the brokers together), ``postgres`` (the private
PostgreSQL), ``replica`` (its streaming standby) and ``local`` (the :class:`Stack` of them all).
Every name is importable from ``kvflow.stack`` as well.
"""

from kvflow.stack.cluster import KafkaCluster
from kvflow.stack.kafka import (
    Kafka,
    broker_port,
    ensure_stack_topics,
    min_insync_replicas,
    new_cluster_id,
    replication_factor,
)
from kvflow.stack.local import Stack, redact_url
from kvflow.stack.postgres import PG_OS_USER, Postgres, cluster_pid, find_pg_bindir
from kvflow.stack.procs import (
    free_port,
    is_root,
    pid_alive,
    pid_cmdline,
    port_open,
    run,
    tail,
    wait_until,
)
from kvflow.stack.replica import REPLICA_SLOT, REPLICA_SLOT_KEEP, PostgresReplica
from kvflow.stack.settings import Paths, ServiceStatus, StackError, StackSettings, project_dir

__all__ = [
    "PG_OS_USER",
    "REPLICA_SLOT",
    "REPLICA_SLOT_KEEP",
    "Kafka",
    "KafkaCluster",
    "Paths",
    "Postgres",
    "PostgresReplica",
    "ServiceStatus",
    "Stack",
    "StackError",
    "StackSettings",
    "broker_port",
    "cluster_pid",
    "ensure_stack_topics",
    "find_pg_bindir",
    "free_port",
    "is_root",
    "min_insync_replicas",
    "new_cluster_id",
    "pid_alive",
    "pid_cmdline",
    "port_open",
    "project_dir",
    "redact_url",
    "replication_factor",
    "run",
    "tail",
    "wait_until",
]
