"""What every ``kvflow`` sub-command shares: the consoles, one-line failures, and the extras.

Errors the user can fix are printed in one line (``kvflow <cmd>: …``) with exit status 1. Each
service is an extra of the package (``pip install 'kvflow[router]'``, README.md "Installing one
service"); a command imports its package inside its function, and :func:`needs_extra` turns a
missing third-party module into the extra to install instead of a traceback.

This module imports only what the base install carries (typer, rich, pydantic through
``kvflow.stack``): ``kvflow --help`` and every command's ``--help`` work without any extra.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from kvflow.stack import StackError
from kvflow.supervise import Stopped

console = Console()
err = Console(stderr=True)
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

#: kvflow's own top-level modules: one of them missing is a broken install, not a missing extra.
FIRST_PARTY = frozenset({"kvflow", "eventbus", "openai_api", "inference_node", "state_store", "routing_api",
                         "bridge", "migrations", "kvflow_native"})


def fail(cmd: str, message: str) -> None:
    err.print(f"[bold red]kvflow {cmd}:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def first_line(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    return (str(orig).strip().splitlines() or [""])[0]


def _expected(exc: Exception) -> bool:
    """An OSError or a SQLAlchemyError (sqlalchemy is not in the base install: only an error of an
    imported sqlalchemy can have been raised)."""
    if isinstance(exc, OSError):
        return True
    sa_exc = sys.modules.get("sqlalchemy.exc")
    return sa_exc is not None and isinstance(exc, sa_exc.SQLAlchemyError)


def guarded(cmd: str, fn: Callable[[], T]) -> T:
    """Run fn; a StackError (or another expected failure) becomes one line and exit 1."""
    try:
        return fn()
    except StackError as exc:
        fail(cmd, str(exc))
    except Stopped as exc:
        fail(cmd, f"stopped by {exc}")
    except KeyboardInterrupt:
        fail(cmd, "interrupted")
    except Exception as exc:
        if not _expected(exc) or os.environ.get("KVFLOW_DEBUG"):
            raise
        fail(cmd, f"{type(exc).__name__}: {first_line(exc)} (KVFLOW_DEBUG=1 for the traceback)")
    raise AssertionError("unreachable")


def missing_module(exc: ModuleNotFoundError) -> str | None:
    """The third-party top-level module that is missing, or None (kvflow's own, or unnamed)."""
    top = (exc.name or "").partition(".")[0]
    return top if top and top not in FIRST_PARTY else None


def missing_extra_message(cmd: str, extra: str, module: str) -> str:
    return f"kvflow {cmd} needs the '{extra}' extra: pip install 'kvflow[{extra}]' (no module named '{module}')"


def needs_extra(extra: str, cmd: str, probe: tuple[str, ...] = ()) -> Callable[[F], F]:
    """``kvflow <cmd>`` needs ``kvflow[extra]``: a third-party module missing while it runs (its lazy
    imports) becomes one line naming the extra, exit status 1 (``KVFLOW_DEBUG=1``: the traceback).
    ``probe``: modules it needs only late (a plot at the end, a child process), looked for first."""

    def say(module: str) -> None:
        err.print(f"[bold red]{escape(missing_extra_message(cmd, extra, module))}[/]", highlight=False,
                  soft_wrap=True)
        raise typer.Exit(1)

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            for wanted in probe:
                if importlib.util.find_spec(wanted) is None:
                    say(wanted)
            try:
                return fn(*args, **kwargs)
            except ModuleNotFoundError as exc:
                module = missing_module(exc)
                if module is None or os.environ.get("KVFLOW_DEBUG"):
                    raise
                say(module)

        return run  # type: ignore[return-value]

    return wrap
