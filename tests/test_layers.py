"""The import rule of the layers (docs/ARCHITECTURE.md), checked by reading every module's imports.

library  epd/                                      imports no role, no control plane, no tools
roles    encode_svc, prefill_svc, decode_svc, router_svc   import the library, never each other
         pd_svc (prefill+decode as one engine)     composes prefill_svc and decode_svc; no role imports it
control  control/                                  imports roles and library (tools: the CLI and demo only)
tools    bench/                                    imports anything; only the CLI and demo import it
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
ROLES = {"encode_svc", "prefill_svc", "decode_svc", "router_svc", "pd_svc"}
COMPOSED = {"pd_svc": {"prefill_svc", "decode_svc"}}  # a role made of others: it may import those
PACKAGES = {"epd", "control", "bench", *ROLES}


def _imports(path: pathlib.Path) -> set[str]:
    """Top-level packages of ours that ``path`` imports (anywhere in the file, lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names} & PACKAGES
    return found


def _modules(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _allowed(package: str, module: pathlib.Path) -> set[str]:
    if package == "epd":
        return {"epd"}
    if package in ROLES:
        return {"epd", package, *COMPOSED.get(package, ())}
    if package == "control":
        return {"epd", "control", *ROLES} | ({"bench"} if module.name in ("cli.py", "demo.py") else set())
    return set(PACKAGES)  # tools


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_module_keeps_the_import_rule(package):
    modules = _modules(package)
    assert modules, f"no modules found under {package}/"
    broken = {str(m.relative_to(ROOT)): sorted(_imports(m) - _allowed(package, m)) for m in modules}
    assert {name: bad for name, bad in broken.items() if bad} == {}


def test_the_rule_catches_a_breach(tmp_path):
    module = tmp_path / "lm.py"
    module.write_text("def f():\n    from decode_svc.batch import DecodeBatch\n    import control.cli\n")
    assert _imports(module) - _allowed("epd", module) == {"decode_svc", "control"}
