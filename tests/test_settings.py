"""One declaration of every ASYNCLOCK_* variable (`asynclock._core.base.settings`):
read when a coordinator starts, checked with a clear error, the docs table generated
from it, and nothing in the repository reads a variable it does not declare."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asynclock._core.base import settings

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("env_table", ROOT / "docs" / "env_table.py")
assert _SPEC is not None and _SPEC.loader is not None
env_table = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(env_table)


@pytest.fixture(autouse=True)
def _no_snapshot() -> None:
    settings.forget()
    yield
    settings.forget()


def test_docs_table_is_generated_from_the_declaration() -> None:
    page = env_table.PAGE.read_text()
    assert env_table.rendered(page) == page, "run: python docs/env_table.py"
    for s in settings.DECLARED:
        assert f"`{s.name}`" in page


def test_every_variable_the_repository_reads_is_declared() -> None:
    declared = {name for s in settings.DECLARED for name in (s.name, *s.replaces)}
    found: dict[str, str] = {}
    for folder in ("asynclock", "mpi", "launch", "tests", "bench", "examples", ".ci"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".sh", ".sbatch", "") and \
                    "__pycache__" not in path.parts:
                for name in re.findall(r"ASYNCLOCK_[A-Z0-9_]*[A-Z0-9]", path.read_text(
                        errors="replace")):
                    found.setdefault(name, str(path.relative_to(ROOT)))
    unknown = {n: where for n, where in found.items() if n not in declared}
    assert not unknown, f"declare these in asynclock/_core/base/settings.py: {unknown}"


def test_values_are_read_at_load_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLOCK_STRAY_S", "3.5")
    settings.load()
    monkeypatch.setenv("ASYNCLOCK_STRAY_S", "7")
    assert settings.number("ASYNCLOCK_STRAY_S") == 3.5  # the snapshot of this coordinator
    assert settings.is_set("ASYNCLOCK_STRAY_S") and not settings.is_set("ASYNCLOCK_SPIN_US")
    settings.forget()
    assert settings.number("ASYNCLOCK_STRAY_S") == 7  # no coordinator: as it is now


def test_defaults_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ASYNCLOCK_SPIN_US", raising=False)
    monkeypatch.setenv("ASYNCLOCK_NODE_WINDOW", "0")
    settings.load()
    assert settings.number("ASYNCLOCK_SPIN_US") == 200
    assert settings.flag("ASYNCLOCK_NODE_WINDOW") is False and settings.flag("ASYNCLOCK_WATCHDOG")
    assert settings.text("ASYNCLOCK_BULK") == "auto"


@pytest.mark.parametrize("old, new, value", [
    ({"ASYNCLOCK_WINDOW": "0"}, {}, False),
    ({"ASYNCLOCK_SHM": "0", "ASYNCLOCK_WINDOW": "1"}, {}, False),
    ({"ASYNCLOCK_SHM": "1"}, {}, True),
    ({"ASYNCLOCK_SHM": "0"}, {"ASYNCLOCK_NODE_WINDOW": "1"}, True),
])
def test_the_node_window_switch_reads_its_old_names_when_unset(
        monkeypatch: pytest.MonkeyPatch, old: dict[str, str], new: dict[str, str],
        value: bool) -> None:
    """`ASYNCLOCK_WINDOW` and `ASYNCLOCK_SHM` were two switches of one mechanism: either
    at 0 turns the window off, unless the new name is set; each old name is warned
    about, and the agreed value is the switch's."""
    monkeypatch.delenv("ASYNCLOCK_NODE_WINDOW", raising=False)
    for name, v in {**old, **new}.items():
        monkeypatch.setenv(name, v)
    with pytest.warns(FutureWarning, match="set ASYNCLOCK_NODE_WINDOW"):
        settings.load()
    assert settings.flag("ASYNCLOCK_NODE_WINDOW") is value
    assert settings.agreed()["ASYNCLOCK_NODE_WINDOW"] == ("1" if value else "0")
    assert settings.is_set("ASYNCLOCK_NODE_WINDOW")
    settings.forget()
    assert settings.flag("ASYNCLOCK_NODE_WINDOW") is value  # read from the environment
    with pytest.raises(KeyError, match="old name of ASYNCLOCK_NODE_WINDOW"):
        settings.flag("ASYNCLOCK_SHM")


@pytest.mark.parametrize("name, value, message", [
    ("ASYNCLOCK_SPIN_US", "fast", "ASYNCLOCK_SPIN_US='fast' is not a number"),
    ("ASYNCLOCK_SHM", "yes", "ASYNCLOCK_SHM='yes': use 0 or 1"),
    ("ASYNCLOCK_BULK", "nccl", "ASYNCLOCK_BULK='nccl': use one of auto, mpi, gloo, measure"),
])
def test_a_bad_value_names_the_variable_at_load(monkeypatch: pytest.MonkeyPatch, name: str,
                                                 value: str, message: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        settings.load()


def test_agreed_settings_are_the_ones_that_change_messages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLOCK_THREAD_MIN_BYTES", "4096")
    settings.load()
    agreed = settings.agreed()
    assert agreed["ASYNCLOCK_THREAD_MIN_BYTES"] == "4096"
    assert "ASYNCLOCK_SPIN_US" not in agreed  # timing only: ranks may differ


def test_undeclared_name_is_refused() -> None:
    with pytest.raises(KeyError, match="not a declared"):
        settings.number("ASYNCLOCK_" + "NO_SUCH_THING")


def test_importing_asynclock_reads_no_setting() -> None:
    """A bad value does not break `import asynclock`: it is reported at init()."""
    code = "import asynclock, asynclock.torch; print('imported')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"ASYNCLOCK_SPIN_US": "fast", "ASYNCLOCK_SHM": "yes",
                               "PATH": "/usr/bin:/bin"}, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-2000:]
