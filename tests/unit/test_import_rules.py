"""The import rules of the layout (docs/design.md#layout), read from each module's imports
with ``ast``.

- the app (``rollpoint.app``: the CLI, the run config, the snapshot listing, the report,
  the chaos runner) stands on top: no layer imports it but the package's faces
  (``rollpoint``, ``rollpoint.__main__``), and none below it names the run config through
  those faces; the job and the façade, like the trainer and the runtimes, are told what they
  need (``JobSettings``, ``TrainerSettings``, ``RuntimeSettings``);
- the job (``rollpoint.job``: one run assembled) is driven from above: only the app, the
  façade and the package's faces import it, and it imports neither the app, nor the façade
  (``rollpoint.rollouts``, ``rollpoint.sync_rollouts``), nor the built-in loop;
- ``rollpoint.common`` (what every layer may use) imports nothing of rollpoint but the
  protocol;
- the test kit (``rollpoint.testing``) is a kit, not the app: it imports neither the app
  nor the built-in loop;
- only the app's commands import the built-in loop: the job takes its hooks from its caller;
- ``rollpoint.participant`` (the SDK) and ``rollpoint.servers`` (the built-in servers) never
  import the trainer side (``rollpoint.trainer``, ``rollpoint.loop``) nor the app;
- the SDK never imports the built-in servers: they are built on it, not it on them;
- a server imports the SDK only through ``rollpoint.participant``, never one of its modules;
- ``rollpoint.protocol`` imports neither side (nor the app, nor the built-in loop);
- the built-in loop (``rollpoint.loop``, what ``rollpoint run`` trains with) imports public
  names only: the façade's (``rollpoint.__all__``), the trainer library's, the protocol;
- the trainer library (``rollpoint.trainer``) imports neither the servers nor the
  participant SDK nor the job nor the app (the CLI, the run config), nor the façade over the
  job, nor the built-in loop:
  what it needs of a run it is told (``TrainerSettings``, ``SaveSettings``);
- the trainer's machinery is layered by role: ``state`` (ledger, finished queue) <
  ``control`` (participant clients, roster) < ``dispatch`` < ``snapshot`` < ``restore``; a
  sub-package imports none above it, ``record`` (rollpoint's own step record) none of them,
  and in the library nothing but the trainer loop imports ``restore``;
- ``rollpoint.store`` knows files: it imports no performance trick (``rollpoint.tuning``),
  neither side, nor the job, nor the app;
- the SDK, the built-in servers and the trainer reach the tricks only through the
  checkpoint seam (``rollpoint.tuning.seam``: the events they emit, the record values they
  hand the writer) and the decode pause they wrap around their own reads
  (``rollpoint.tuning.collector_pause``): no fence nor coordinator holds a collector of its
  own, no server imports a trick's module;
- the tricks are installed by the entry points alone (a server process, ``run_job``,
  ``LocalCluster``), and nothing else outside ``rollpoint.tuning`` uses the collector
  schedule but the scripted policy, which takes no part in checkpoints.

Every import counts: at the top, inside a function, under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import rollpoint
import rollpoint.participant
import rollpoint.trainer

SRC = Path(rollpoint.__file__).parent
APP = ("rollpoint.app",)
"""The CLI, the job, the run config and what only the ``rollpoint`` command does."""
RUN_CONFIG_FACES = ("rollpoint.RunConfig", "rollpoint.load_config", "rollpoint.parse_config")
"""The run config as the package's face exports it (for a user's script, not for a layer)."""
JOB = ("rollpoint.job",)
"""One run assembled: what the app and the façade drive."""
FACADE = ("rollpoint.rollouts", "rollpoint.sync_rollouts")
FACES = {"rollpoint", "rollpoint.__main__"}
"""The package's faces: ``rollpoint.RunConfig`` (lazily) and the ``rollpoint`` script."""
COMMON = ("rollpoint.common",)
LOOP = ("rollpoint.loop",)
"""The built-in loop ``rollpoint run`` trains with, built on the façade."""
FACADE_OVER_THE_JOB = ("rollpoint.rollouts", "rollpoint.sync_rollouts", "rollpoint.preemption")
TRAINER = ("rollpoint.trainer",)
ENVIRONMENT_SIDE = ("rollpoint.participant", "rollpoint.servers")
SDK_PUBLIC = set(rollpoint.participant.__all__)
TUNING = ("rollpoint.tuning",)
SEAM_SIDE = ("rollpoint.tuning.seam", "rollpoint.tuning.collector_pause")
"""What of ``rollpoint.tuning`` the SDK, the servers and the trainer may import."""
INSTALLERS = {
    "rollpoint.runtime.server_process",
    "rollpoint.job.run",
    "rollpoint.testing.local_cluster",
}
"""The entry points that install the tricks (the façade and chaos trials go through run_job)."""


def _modules(package: str) -> list[Path]:
    return sorted((SRC / package).rglob("*.py"))


def _all_modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


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


def _importers(targets: tuple[str, ...]) -> set[str]:
    """Modules outside ``targets`` importing any of them (or a module under them)."""
    return {
        _name(path)
        for path in _all_modules()
        if not _under(_name(path), targets)
        for _, module in _imports(path)
        if _under(module, targets)
    }


def test_no_layer_imports_the_app() -> None:
    assert _modules("app"), "no modules under rollpoint/app"
    assert _importers(APP) - FACES == set()


def test_no_layer_below_the_app_names_the_run_config_through_the_faces() -> None:
    found = [
        f"{path.relative_to(SRC)}:{line} imports {module}"
        for path in _all_modules()
        if not _under(_name(path), APP) and _name(path) not in FACES
        for line, module in _imports(path)
        if module in RUN_CONFIG_FACES
    ]
    assert found == []


def test_the_job_is_driven_from_above_and_imports_nothing_above_it() -> None:
    assert _modules("job"), "no modules under rollpoint/job"
    assert _violations("job", APP + FACADE + LOOP) == []
    drivers = {m for m in _importers(JOB) if not _under(m, APP)}
    assert drivers == {"rollpoint", *FACADE}


def test_the_common_modules_import_nothing_of_rollpoint_but_the_protocol() -> None:
    assert _modules("common"), "no modules under rollpoint/common"
    found = [
        f"{path.relative_to(SRC)}:{line} imports {module}"
        for path in _modules("common")
        for line, module in _imports(path)
        if _under(module, ("rollpoint",)) and not _under(module, ("rollpoint.protocol", *COMMON))
    ]
    assert found == []


def test_the_test_kit_is_a_kit_not_the_app() -> None:
    assert _modules("testing"), "no modules under rollpoint/testing"
    assert _violations("testing", APP + LOOP) == []


def test_only_the_apps_commands_import_the_built_in_loop() -> None:
    # The job (and the façade it serves) take the hooks they run from their caller: an
    # arrow from either to the loop would run back up (the loop is built on the façade).
    assert _importers(LOOP) == {"rollpoint.app.cli", "rollpoint.app.chaos.trial"}


@pytest.mark.parametrize("package", ["participant", "servers"])
def test_the_environment_side_imports_no_trainer_nor_app(package: str) -> None:
    assert _modules(package), f"no modules under rollpoint/{package}"
    assert _violations(package, TRAINER + LOOP + APP) == []


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
    assert _violations("protocol", ENVIRONMENT_SIDE + TRAINER + LOOP + APP) == []


def test_the_trainer_library_imports_no_server_nor_sdk_nor_app() -> None:
    assert _modules("trainer"), "no modules under rollpoint/trainer"
    assert _violations("trainer", ENVIRONMENT_SIDE + APP + JOB + FACADE_OVER_THE_JOB + LOOP) == []


TRAINER_LAYERS = ("state", "control", "dispatch", "snapshot", "restore")
"""The trainer's sub-packages by role, from the bottom up."""


def _trainer_package(layer: str) -> tuple[str, ...]:
    return (f"rollpoint.trainer.{layer}",)


@pytest.mark.parametrize("layer", TRAINER_LAYERS)
def test_each_trainer_sub_package_imports_none_above_it(layer: str) -> None:
    assert _modules(f"trainer/{layer}"), f"no modules under rollpoint/trainer/{layer}"
    above = TRAINER_LAYERS[TRAINER_LAYERS.index(layer) + 1 :]
    forbidden = tuple(p for upper in above for p in _trainer_package(upper))
    assert _violations(f"trainer/{layer}", forbidden) == []


def test_the_trainers_own_record_imports_none_of_its_machinery() -> None:
    # rollpoint's step record is a file format a trainer of its own may replace: it knows
    # the train hooks' samples, not the ledger, the dispatcher nor a snapshot.
    assert _modules("trainer/record"), "no modules under rollpoint/trainer/record"
    forbidden = tuple(p for layer in TRAINER_LAYERS for p in _trainer_package(layer))
    assert _violations("trainer/record", forbidden) == []


def test_in_the_trainer_library_only_the_trainer_loop_imports_the_restore_order() -> None:
    # (The job picks the snapshot to resume from with it: the app stands above the library.)
    inside = {m for m in _importers(_trainer_package("restore")) if _under(m, TRAINER)}
    assert inside == {"rollpoint.trainer.trainer"}


PUBLIC = {
    "rollpoint": set(rollpoint.__all__),
    "rollpoint.trainer": set(rollpoint.trainer.__all__),
}
"""The packages the built-in loop may take names from, and the names each makes public."""


def _outside_the_public_names(module: str) -> bool:
    """Whether ``module`` (as :func:`_imports_of` yields it) is neither a public package nor
    one of its public names, the protocol, nor the loop's own."""
    if module in PUBLIC or _under(module, ("rollpoint.protocol", *LOOP)):
        return False
    package, _, name = module.rpartition(".")
    return not (package in PUBLIC and name in PUBLIC[package]) and module.startswith("rollpoint")


def test_the_built_in_loop_is_built_on_public_names_only() -> None:
    # ``rollpoint run`` makes the calls a trainer of your own makes: the façade's, the
    # trainer library's ``__all__``, the wire models and errors; no private module.
    assert _modules("loop"), "no modules under rollpoint/loop"
    found = [
        f"{path.relative_to(SRC)}:{line} imports {module}"
        for path in _modules("loop")
        for line, module in _imports(path)
        if _outside_the_public_names(module)
    ]
    assert found == []


def test_the_store_imports_no_trick_neither_side_nor_the_app() -> None:
    assert _modules("store"), "no modules under rollpoint/store"
    assert _violations("store", TUNING + ENVIRONMENT_SIDE + TRAINER + JOB + APP) == []


@pytest.mark.parametrize("package", ["participant", "servers", "trainer"])
def test_the_sdk_the_servers_and_the_trainer_reach_the_tricks_only_through_the_seam(
    package: str,
) -> None:
    assert _modules(package), f"no modules under rollpoint/{package}"
    found = [
        f"{path.relative_to(SRC)}:{line} imports {module}"
        for path in _modules(package)
        for line, module in _imports(path)
        # ``from rollpoint.tuning import seam`` also yields the package itself.
        if _under(module, TUNING) and module != "rollpoint.tuning" and not _under(module, SEAM_SIDE)
    ]
    assert found == []


def _importers_outside_tuning(*targets: str) -> set[str]:
    """Modules outside ``rollpoint.tuning`` importing any of ``targets`` (or under them)."""
    return {
        _name(path)
        for path in _all_modules()
        if not _under(_name(path), TUNING)
        for _, module in _imports(path)
        if _under(module, targets)
    }


def test_only_the_entry_points_install_the_tricks() -> None:
    installers = _importers_outside_tuning(
        "rollpoint.tuning.install", "rollpoint.tuning.collector_listener"
    )
    assert installers == INSTALLERS


def test_no_module_but_the_tricks_and_the_scripted_policy_uses_the_collector_schedule() -> None:
    users = _importers_outside_tuning("rollpoint.tuning.collector_schedule")
    assert users == {"rollpoint.policy.scripted_policy"}


def test_the_reader_sees_every_kind_of_import() -> None:
    # The rules are only as good as the reader: relative, local and guarded imports count.
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ..model import model_server\n"
        "def f():\n"
        "    import rollpoint.trainer.state.ledger\n"
        "    from . import session\n"
    )
    found = {m for _, m in _imports_of(source, "rollpoint.servers.agent.x", is_package=False)}
    assert {
        "rollpoint.servers.model",
        "rollpoint.servers.model.model_server",
        "rollpoint.trainer.state.ledger",
        "rollpoint.servers.agent.session",
    } <= found
