"""The house rules the code keeps, checked on every run (the import contracts are in pyproject.toml,
checked by ``lint-imports`` in .ci/run):

1. Keras internals are touched in one module only: ``keras.src``, the private Keras names the seam
   lists, and patches of Keras classes appear nowhere but rdkeras/keras_internals.py.
2. The environment is read in rdkeras/options.py (every ``RDKERAS_*`` setting) and rdkeras/cluster.py
   (the job's shape) only.
3. Transports are named in their registry (rdkeras/transports/) only: nothing else branches on a name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from rdkeras import keras_internals, transports

PACKAGE = Path(__file__).resolve().parents[2] / "rdkeras"
SEAM = PACKAGE / "keras_internals.py"

# Modules allowed to touch os.environ, and why (reading a setting is options.py's and cluster.py's job).
ENVIRONMENT_USERS = {
    "options.py": "reads every RDKERAS_* setting",
    "cluster.py": "reads the job's shape (launcher, TF_CONFIG, torchrun, SLURM)",
    "launch.py": "passes this process's environment on to the workers it starts",
    "train/app.py": "sets Hydra's own HYDRA_FULL_ERROR while Hydra runs, and restores it",
}
# Modules allowed a transport's name as a string, and why.
TRANSPORT_NAMERS = {
    "transports": "the registry and the backends themselves",
    "bench": "benchmarks compare transports by name, side by side",
    "doctor.py": "diagnoses each transport in turn",
    "cluster.py": "'grpc' there is TensorFlow's rpc_layer, not a transport",
}


def _modules(exempt: dict[str, str] | None = None) -> Iterator[tuple[str, ast.AST]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if exempt and (name in exempt or name.split("/")[0] in exempt):
            continue
        yield name, ast.parse(path.read_text(), filename=str(path))


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (their words are prose, not code)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _rooted_at(node: ast.AST, name: str) -> bool:
    """Whether an attribute chain starts at the name `name` (keras.Model.fit -> keras)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id == name


def test_keras_internals_are_touched_in_the_seam_only():
    private = {attr for _, attr in keras_internals._HOOKS if attr.startswith("_")}
    found = []
    for name, tree in _modules({"keras_internals.py": "the seam"}):
        for node in ast.walk(tree):
            where = f"rdkeras/{name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras.src"):
                found.append(f"{where} imports {node.module}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("keras.src") for a in node.names):
                found.append(f"{where} imports keras.src")
            elif isinstance(node, ast.Attribute) and node.attr in private and not _rooted_at(node, "keras_internals"):
                found.append(f"{where} uses Keras's private {node.attr}")
            elif isinstance(node, ast.Constant) and node.value in private:
                found.append(f"{where} names Keras's private {node.value}")
            elif isinstance(node, ast.Assign) and any(_rooted_at(t, "keras") for t in node.targets):
                found.append(f"{where} assigns to a Keras class")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and node.args
                and _rooted_at(node.args[0], "keras")
            ):
                found.append(f"{where} patches a Keras class")
            elif isinstance(node, ast.Attribute) and node.attr == "__setattr__" and _rooted_at(node, "object"):
                found.append(f"{where} sets an attribute past Keras's tracking")
    assert found == [], "Keras internals belong in rdkeras/keras_internals.py:\n" + "\n".join(found)


def test_the_rule_sees_what_it_forbids():
    tree = ast.parse("import keras\nkeras.Model.fit = f\nsetattr(keras.Model, 'fit', f)\nm._compile_loss\n")
    assigns = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)]
    assert _rooted_at(assigns[0].targets[0], "keras")
    assert any(isinstance(n, ast.Attribute) and n.attr == "_compile_loss" for n in ast.walk(tree))


def test_the_environment_is_read_in_options_and_cluster_only():
    found = []
    for name, tree in _modules(ENVIRONMENT_USERS):
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv")) or (
                isinstance(node, ast.Name) and node.id in ("environ", "getenv")
            ):
                found.append(f"rdkeras/{name}:{node.lineno}")
    assert found == [], "read settings through rdkeras.options (or rdkeras.cluster):\n" + "\n".join(found)


@pytest.mark.parametrize("name", transports.names())
def test_transports_are_named_in_their_registry_only(name):
    found = []
    for module, tree in _modules(TRANSPORT_NAMERS):
        prose = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == name and id(node) not in prose:
                found.append(f"rdkeras/{module}:{node.lineno}")
    assert found == [], (
        f"{name!r} outside rdkeras/transports/ (ask the registry what a transport can do):\n" + "\n".join(found)
    )
