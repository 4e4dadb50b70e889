"""Who may import whom: gateway and runner meet only in fngate (through Redis), and fngate imports
neither, except the CLI inside its subcommands."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_packages(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize(("package", "forbidden"), [("gateway", "runner"), ("runner", "gateway")])
def test_gateway_and_runner_never_import_each_other(package: str, forbidden: str) -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / package).rglob("*.py"))
        if forbidden in imported_packages(path, top_level_only=False)
    ]
    assert offenders == []


def test_fngate_imports_gateway_and_runner_only_inside_functions() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "fngate").rglob("*.py"))
        if imported_packages(path, top_level_only=True) & {"gateway", "runner"}
    ]
    assert offenders == []


def test_only_the_cli_starts_gateways_and_runners() -> None:
    """The shared core never reaches into gateway or runner, even inside a function; only the
    console script, which launches them, does."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "fngate").rglob("*.py"))
        if path.relative_to(ROOT).as_posix() != "fngate/cli/main.py"
        and imported_packages(path, top_level_only=False) & {"gateway", "runner"}
    ]
    assert offenders == []


def test_heavy_clients_are_imported_only_where_used() -> None:
    """boto3 loads with an S3 repository, not with fngate: gateways and the CLI stay light."""
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("fngate", "gateway")
        for path in sorted((ROOT / package).rglob("*.py"))
        if imported_packages(path, top_level_only=True) & {"boto3", "botocore", "onnxruntime", "tensorrt"}
    ]
    assert offenders == []


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node but what sits under `if TYPE_CHECKING:` (imports for annotations only)."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            todo += node.orelse
            continue
        todo += ast.iter_child_nodes(node)
    return out


def module_imports(path: Path) -> set[str]:
    """Project modules this module imports, at its top level or inside a function (an import put in
    a function to dodge a circle is still a circle)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.split(".")[0] in {"fngate", "gateway", "runner"}}


def test_no_import_circles() -> None:
    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for package in ("fngate", "gateway", "runner")
        for path in (ROOT / package).rglob("*.py")
    }
    # A package's loader table may import its own modules lazily (runner.backends): not a circle.
    graph = {
        name: {dep for dep in module_imports(path) if dep in modules and not dep.startswith(name)}
        for name, path in modules.items()
    }
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")


TOOLING = ("fngate.cli", "fngate.up", "fngate.k8s")
TOOLING_PATHS = ("fngate/cli/", "fngate/up/", "fngate/k8s.py")


def test_gateway_runner_and_the_core_never_import_the_tooling() -> None:
    """The tooling (fngate.cli, fngate.up and fngate.k8s: the CLI, `fngate up`, the Kubernetes
    renderer) sits on top: nothing serving traffic, and nothing in the shared core, depends on it."""
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("gateway", "runner", "fngate")
        for path in sorted((ROOT / package).rglob("*.py"))
        if not str(path.relative_to(ROOT)).startswith(TOOLING_PATHS)
        and any(
            name == tool or name.startswith(f"{tool}.") for name in module_imports(path) for tool in TOOLING
        )
    ]
    assert offenders == []


FRONT_ENDS = {
    "gateway.http": {"starlette", "uvicorn", "hypercorn", "httptools"},
    "gateway.grpc": {"grpc", "h2", "hpack"},
}
COMPOSITION_ROOTS = {"gateway/app.py", "gateway/__main__.py"}


def test_the_gateways_core_knows_no_protocol() -> None:
    """The core (gateway/ outside its front ends) imports neither front end nor what they are built
    on: routes, headers, statuses and protobuf messages stay in gateway/http and gateway/grpc. Only
    the composition roots wire them together."""
    offenders = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if where in COMPOSITION_ROOTS or where.startswith(("gateway/http/", "gateway/grpc/")):
            continue
        imported = module_imports(path) | imported_packages(path, top_level_only=False)
        forbidden = set(FRONT_ENDS) | set().union(*FRONT_ENDS.values())
        bad = sorted(name for name in imported if name in forbidden or name.startswith(tuple(FRONT_ENDS)))
        if bad:
            offenders.append(f"{where}: {bad}")
    assert offenders == []


def test_the_front_ends_do_not_import_each_other() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for front, other in (("http", "gateway.grpc"), ("grpc", "gateway.http"))
        for path in sorted((ROOT / "gateway" / front).rglob("*.py"))
        if any(name.startswith(other) for name in module_imports(path))
    ]
    assert offenders == []


def test_triton_schema_loads_only_where_a_triton_repository_is_read() -> None:
    """protobuf and tritonclient load with fngate.triton (imported when a Triton model folder is
    read) and the gRPC front end, never with the rest of fngate or the gateway's core."""
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("fngate", "gateway")
        for path in sorted((ROOT / package).rglob("*.py"))
        if not {"triton", "grpc"} & set(path.relative_to(ROOT).parts)
        and imported_packages(path, top_level_only=True) & {"tritonclient", "google"}
    ]
    assert offenders == []


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports by its full name (anywhere in it)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_uvicorns_private_surface_is_confined_to_one_module() -> None:
    """uvicorn's protocol internals (its httptools protocol, whose request cycle and flow control the
    lean invoke path reaches into) are touched by gateway/http/uvicorn_link.py alone: a uvicorn release
    that renames one of them breaks that module, and the exchange (gateway/http/lean.py) stays
    server-neutral. The rest may use uvicorn's public API (uvicorn.Config, uvicorn.Server)."""
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("fngate", "gateway", "runner", "bench")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.relative_to(ROOT).as_posix() != "gateway/http/uvicorn_link.py"
        and any(module.startswith("uvicorn.") for module in imported_modules(path))
    ]
    assert offenders == []
    assert "uvicorn" not in imported_packages(ROOT / "gateway" / "http" / "lean.py", top_level_only=False)
