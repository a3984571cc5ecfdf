"""Every third-party package the library imports is declared, and pinned where the install pins."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[=<>!~\[; ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _imported_distributions() -> dict[str, str]:
    """distribution name -> one file that imports it, for every top-level import in pagedllm/."""
    modules: dict[str, str] = {}
    for path in sorted((ROOT / "pagedllm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "pagedllm" and top not in sys.stdlib_module_names:
                    modules.setdefault(top, str(path.relative_to(ROOT)))
    owners = importlib.metadata.packages_distributions()
    found = {}
    for module, where in modules.items():
        assert module in owners, f"{where} imports {module}, which no installed distribution provides"
        for distribution in owners[module]:
            found[_name(distribution)] = where
    return found


def test_every_imported_package_is_declared_in_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    declared |= {_name(r) for extra in project["optional-dependencies"].values() for r in extra}
    missing = {d: where for d, where in _imported_distributions().items() if d not in declared}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_every_imported_package_is_pinned_by_the_install() -> None:
    pinned = set()
    for line in (ROOT / "requirements.txt").read_text().splitlines() + \
            (ROOT / "requirements-test.txt").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            pinned.add(_name(line))
    install = (ROOT / "scripts" / "install.sh").read_text()
    pinned |= {_name(m) for m in re.findall(r"--no-deps ([A-Za-z0-9_.-]+==[0-9][^\s]*)", install)}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned_in_pyproject = {_name(r) for r in project["dependencies"] if "==" in r}
    unpinned = {d: where for d, where in _imported_distributions().items() if d not in pinned}
    assert not unpinned, f"imported but pinned by neither requirements file nor install.sh: {unpinned}"
    # What install.sh puts in with --no-deps has no resolver behind it: pyproject names the same version.
    for requirement in re.findall(r"--no-deps ([A-Za-z0-9_.-]+==[0-9][^\s]*)", install):
        if _name(requirement) in {_name(r) for r in project["dependencies"]}:
            assert _name(requirement) in pinned_in_pyproject, f"pyproject.toml leaves {requirement} unpinned"
