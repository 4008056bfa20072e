"""The package's shape: numerics in fa_jax/, engines in fa_jax/kernels/, studies in
fa_jax/studies/, arrows pointing down."""

import ast
import pathlib
import subprocess
import sys

import pytest

import fa_jax

PACKAGE = pathlib.Path(fa_jax.__file__).parent
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
NUMERICS = [p for p in MODULES if "studies" not in p.relative_to(PACKAGE).parts]
MAX_DOCSTRING_LINES = 60


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Modules a file imports at run time (imports under ``if TYPE_CHECKING:`` excluded)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return names


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


@pytest.mark.parametrize("path", [p for p in NUMERICS if p.name != "cli.py"], ids=_rel)
def test_numerics_do_not_import_the_studies(path):
    studies = {m for m in _imported_modules(path) if m.startswith("fa_jax.studies")}
    assert not studies, f"{_rel(path)} imports {sorted(studies)}"


CORE = [p for p in MODULES if p.parent == PACKAGE and p.name != "cli.py"]


@pytest.mark.parametrize("path", CORE, ids=_rel)
def test_the_core_knows_no_engine(path):
    engines = {m for m in _imported_modules(path) if m.startswith("fa_jax.kernels")}
    assert not engines, f"{_rel(path)} imports {sorted(engines)}"


def test_each_engine_keeps_to_its_folder():
    """An engine's folder imports no other engine's (kernels/x86/ is shared)."""
    kernels = PACKAGE / "kernels"
    folders = [p for p in kernels.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    engines = {p.name for p in folders} - {"x86"}
    for folder in folders:
        for path in folder.rglob("*.py"):
            others = {
                m
                for m in _imported_modules(path)
                if m.split(".")[:2] == ["fa_jax", "kernels"]
                and len(m.split(".")) > 2
                and m.split(".")[2] in engines - {folder.name}
            }
            assert not others, f"{_rel(path)} imports {sorted(others)}"


def test_import_fa_jax_loads_no_study_and_no_engine():
    code = "import sys, fa_jax; print(sorted(m for m in sys.modules if m.startswith('fa_jax')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = eval(out.stdout)
    assert loaded and not [m for m in loaded if m.startswith("fa_jax.studies")], loaded
    assert not [m for m in loaded if m.startswith("fa_jax.kernels")], loaded
    assert "fa_jax.cli" not in loaded


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_only_the_cli_parses_arguments(path):
    if path.name == "cli.py" and path.parent == PACKAGE:
        return
    assert "argparse" not in _imported_modules(path), f"{_rel(path)} imports argparse"


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_module_docstrings_are_short(path):
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
    assert doc, f"{_rel(path)} has no module docstring"
    n = len(doc.splitlines())
    assert n <= MAX_DOCSTRING_LINES, f"{_rel(path)}: module docstring of {n} lines"


def test_every_exported_name_resolves():
    for name in fa_jax.__all__:
        assert getattr(fa_jax, name) is not None, name


def test_names_kept_from_the_flat_layout():
    # Names users had before the studies moved out keep working.
    from fa_jax.studies import attribution

    assert fa_jax.attribute is attribution.attribute
    assert fa_jax.AttributionConfig is attribution.AttributionConfig
    assert fa_jax.policies is fa_jax.presets
    assert fa_jax.policies.get_policy("fa2_kernel", "bf16") == fa_jax.fa2_kernel(fa_jax.BF16)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = fa_jax.nope


def test_python_dash_m_runs_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "fa_jax", "--help"], capture_output=True, text=True, check=True
    )
    assert "usage: fa-jax" in out.stdout
