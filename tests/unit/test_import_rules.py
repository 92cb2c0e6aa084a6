"""The import rules of the layout (DESIGN.md §9), read from each module's imports with ``ast``.

- ``rollpoint.participant`` (the SDK) and ``rollpoint.servers`` (the built-in servers) never
  import the trainer side (``rollpoint.trainer``, where the built-in loop lives too) nor the
  app (``rollpoint.cli``, ``rollpoint.job``, ``rollpoint.config``);
- the SDK never imports the built-in servers: they are built on it, not it on them;
- a server imports the SDK only through ``rollpoint.participant``, never one of its modules;
- ``rollpoint.protocol`` imports neither side (nor the app);
- the trainer library (``rollpoint.trainer``) imports neither the servers nor the
  participant SDK nor the app (the CLI, the job, the run config, the façade over the job):
  what it needs of a run it is told (``TrainerSettings``, ``SaveSettings``).

Every import counts: at the top, inside a function, under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import rollpoint
import rollpoint.participant

SRC = Path(rollpoint.__file__).parent
APP = ("rollpoint.cli", "rollpoint.job", "rollpoint.config")
FACADE_OVER_THE_JOB = ("rollpoint.rollouts", "rollpoint.preemption")
TRAINER = ("rollpoint.trainer",)
ENVIRONMENT_SIDE = ("rollpoint.participant", "rollpoint.servers")
SDK_PUBLIC = set(rollpoint.participant.__all__)


def _modules(package: str) -> list[Path]:
    return sorted((SRC / package).rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    return _imports_of(path.read_text(), _name(path), is_package=path.name == "__init__.py")


def _imports_of(source: str, module: str, *, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source`` (the text of ``module``);
    ``from x import y`` also yields ``x.y`` (y may be a module)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(SRC)}:{line} imports {module}"
        for path in _modules(package)
        for line, module in _imports(path)
        if _under(module, forbidden)
    ]


@pytest.mark.parametrize("package", ["participant", "servers"])
def test_the_environment_side_imports_no_trainer_nor_app(package: str) -> None:
    assert _modules(package), f"no modules under rollpoint/{package}"
    assert _violations(package, TRAINER + APP) == []


def test_the_sdk_imports_none_of_the_built_in_servers() -> None:
    assert _violations("participant", ("rollpoint.servers",)) == []


def test_the_servers_import_the_sdk_only_through_its_package() -> None:
    private = [
        f"{path.relative_to(SRC)}:{line} imports {module}"
        for path in _modules("servers")
        for line, module in _imports(path)
        if module.startswith("rollpoint.participant.")
        # ``from rollpoint.participant import Fence`` also yields "rollpoint.participant.Fence":
        # a public name, not a module.
        and module.removeprefix("rollpoint.participant.") not in SDK_PUBLIC
    ]
    assert private == []


def test_the_protocol_imports_neither_side_nor_the_app() -> None:
    assert _violations("protocol", ENVIRONMENT_SIDE + TRAINER + APP) == []


def test_the_trainer_library_imports_no_server_nor_sdk_nor_app() -> None:
    assert _modules("trainer"), "no modules under rollpoint/trainer"
    assert _violations("trainer", ENVIRONMENT_SIDE + APP + FACADE_OVER_THE_JOB) == []


def test_the_reader_sees_every_kind_of_import() -> None:
    # The rules are only as good as the reader: relative, local and guarded imports count.
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ..model import model_server\n"
        "def f():\n"
        "    import rollpoint.trainer.ledger\n"
        "    from . import session\n"
    )
    found = {m for _, m in _imports_of(source, "rollpoint.servers.agent.x", is_package=False)}
    assert {
        "rollpoint.servers.model",
        "rollpoint.servers.model.model_server",
        "rollpoint.trainer.ledger",
        "rollpoint.servers.agent.session",
    } <= found
