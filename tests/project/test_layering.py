"""The package's shape: layers, no import circles, no oversized classes or functions.

The layering is written once, in ``tq_async/__init__.py``'s docstring; ``LAYERS`` below is the
same table, checked against every ``import`` in ``src/tq_async`` (module-level, function-local
and ``TYPE_CHECKING`` imports alike: each is an edge).
"""

from __future__ import annotations

import ast
import io
import pathlib
import tokenize

import tq_async

SRC = pathlib.Path(tq_async.__file__).parent
PACKAGE = "tq_async"

#: lowest first; a module may import its own layer and the layers below, never above
LAYERS: dict[str, list[str]] = {
    "vocabulary": [
        "_errors",
        "_logging",
        "_portal",
        "_primitives",
        "_sync_primitives",
        "_meta",
        "_wire",
        "samplers",
    ],
    "core": ["_core"],
    "transport": ["_transport", "_paths"],
    "services and clients": ["_service", "_controller", "_storage", "_client"],
    "faces": [
        "_deploy",
        "_datasets",
        "compat",
        "transfer_queue",
        "ray",
        "events",
        "lowlevel",
        "__init__",
    ],
}

MAX_CLASS_LINES = 600
MAX_FUNCTION_LINES = 80
#: issue 35's limits, in code lines (no blank lines, comments or docstrings)
MAX_MODULE_CODE_LINES = 600
MAX_CLASS_CODE_LINES = 350
MAX_SERVER_CODE_LINES = 250
#: the services' servers: dispatch and lifecycle, holding their parts
SERVERS = ["_controller._server.ControllerServer", "_storage._server.StorageServer"]


def _modules() -> dict[str, pathlib.Path]:
    """``{"_client": path, "samplers._base": path, "__init__": path, ...}``."""
    out: dict[str, pathlib.Path] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        name = ".".join(rel.parts)
        out[name] = path
    return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The tq_async modules ``name`` imports, wherever the import statement sits."""
    package = name.split(".")[:-1]  # "samplers._base" -> ["samplers"]; "_client" -> []
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                prefix = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.split(".")[0] == PACKAGE:
                prefix = node.module.partition(".")[2]
            else:
                continue
            targets = [prefix, *(f"{prefix}.{a.name}" if prefix else a.name for a in node.names)]
        elif isinstance(node, ast.Import):
            targets = [
                a.name.partition(".")[2] for a in node.names if a.name.split(".")[0] == PACKAGE
            ]
        for target in targets:
            for candidate in (target, f"{target}.__init__" if target else "__init__"):
                if candidate in known and candidate != name:
                    found.add(candidate)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _layer_of(module: str) -> int:
    top = module.split(".")[0]
    for rank, members in enumerate(LAYERS.values()):
        if top in members:
            return rank
    raise AssertionError(
        f"module {module!r} is in no layer: add it to LAYERS here and to the layering in "
        "tq_async/__init__.py's docstring"
    )


def test_no_import_circles() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_a_higher_layer() -> None:
    names = list(LAYERS)
    upward = [
        f"{module} ({names[_layer_of(module)]}) imports {target} ({names[_layer_of(target)]})"
        for module, targets in _graph().items()
        for target in sorted(targets)
        if _layer_of(target) > _layer_of(module)
    ]
    assert upward == []


def test_every_module_has_a_layer_and_every_listed_module_exists() -> None:
    tops = {name.split(".")[0] for name in _modules()}
    for module in tops:
        _layer_of(module)
    listed = {m for members in LAYERS.values() for m in members}
    assert listed - tops == set()


def test_the_layering_is_written_in_the_package_docstring() -> None:
    doc = tq_async.__doc__ or ""
    for layer in LAYERS:
        assert layer in doc, layer


def _code_lines(node: ast.AST) -> int:
    """Lines of ``node`` not taken by docstrings (its own or nested definitions')."""
    doc: set[int] = set()
    for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = inner.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                doc.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    start, end = node.lineno, node.end_lineno or node.lineno  # type: ignore[attr-defined]
    return sum(1 for line in range(start, end + 1) if line not in doc)


def test_no_class_or_function_is_too_long() -> None:
    too_long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and _code_lines(node) > MAX_CLASS_LINES:
                too_long.append(f"class {name}.{node.name}: {_code_lines(node)} lines")
            is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if is_function and _code_lines(node) > MAX_FUNCTION_LINES:
                too_long.append(f"def {name}.{node.name}: {_code_lines(node)} lines")
    assert too_long == []


def _counted_lines(text: str, tree: ast.Module) -> set[int]:
    """The lines of a module that hold code: not blank, not only a comment, not a docstring
    (issue 35 counts sizes this way)."""
    doc: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                doc.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    skip |= {tokenize.ENCODING, tokenize.ENDMARKER}
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type not in skip:
            code.update(range(tok.start[0], tok.end[0] + 1))
    return code - doc


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """Code lines per module and per class (``module.Class``)."""
    modules: dict[str, int] = {}
    classes: dict[str, int] = {}
    for name, path in _modules().items():
        text = path.read_text()
        tree = ast.parse(text)
        lines = _counted_lines(text, tree)
        modules[name] = len(lines)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                classes[f"{name}.{node.name}"] = len(lines.intersection(span))
    return modules, classes


def test_no_module_or_class_outgrows_the_house() -> None:
    """Issue 35's limits, in code lines (no blank lines, comments or docstrings): a module
    <= 600, a class <= 350, the two servers (dispatch and lifecycle, holding their parts)
    < 250."""
    modules, classes = _sizes()
    too_big = [f"module {m}: {n}" for m, n in modules.items() if n > MAX_MODULE_CODE_LINES]
    too_big += [f"class {c}: {n}" for c, n in classes.items() if n > MAX_CLASS_CODE_LINES]
    too_big += [f"server {c}: {classes[c]}" for c in SERVERS if classes[c] >= MAX_SERVER_CODE_LINES]
    assert too_big == [], "split along a real seam (a part the class holds): " + str(too_big)


def test_the_size_count_skips_docstrings_comments_and_blank_lines() -> None:
    text = 'class A:\n    """Doc\n    string."""\n\n    # a comment\n    x = 1  # code\n'
    assert len(_counted_lines(text, ast.parse(text))) == 2  # "class A:" and "x = 1"


#: the controller's I/O shell: it reads the state, every change is a transition of the core
SHELL = [
    "_controller._server",
    "_controller._shell",
    "_controller._units",
    "_controller._puts",
    "_controller._gets",
    "_controller._calls",
    "_controller._queries",
    "_controller._watch",
    "_controller._journal",
]
#: how the shell's modules reach the state: the server, each part, the core they hold
STATE_ROOTS = {"self.state", "self.shell.state", "self.core.state", "self.shell.core.state"}
#: methods that change a ControllerState, a Partition or one of their containers
MUTATORS = {
    "add_fields",
    "allocate",
    "append",
    "clear",
    "commit",
    "consume",
    "extend",
    "pop",
    "popitem",
    "popleft",
    "put_begin",
    "release",
    "remove",
    "reset_consumption",
    "restore_begin",
    "seal",
    "set_tags",
    "setdefault",
    "update",
}


def _state_writes(tree: ast.AST) -> list[str]:
    """Writes through ``self.state`` (or a name bound from it) in a module of the shell."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        tainted = set(STATE_ROOTS)
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and any(
                ast.unparse(node.value).startswith(t) for t in tainted
            ):
                tainted |= {ast.unparse(t) for t in node.targets}

        def from_state(expr: ast.AST, tainted: set[str] = tainted) -> bool:
            text = ast.unparse(expr)
            return any(text == t or text.startswith((t + ".", t + "[")) for t in tainted)

        for node in ast.walk(fn):
            targets: list[ast.AST] = []
            if isinstance(node, (ast.Assign, ast.Delete)):
                targets = list(node.targets)
            elif isinstance(node, ast.AugAssign):
                targets = [node.target]
            found.extend(
                f"{fn.name}: {ast.unparse(t)} ="
                for t in targets
                if isinstance(t, (ast.Attribute, ast.Subscript)) and from_state(t.value)
            )
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in MUTATORS
                and from_state(node.func.value)
            ):
                found.append(f"{fn.name}: {ast.unparse(node.func)}()")
    return found


def test_the_controller_shell_changes_state_only_through_the_core() -> None:
    assert {m for m in _modules() if m.startswith("_controller.")} - {
        "_controller.__init__"
    } == set(SHELL), "a new module of the controller's shell: add it to SHELL"
    writes = []
    for name in SHELL:
        writes += [f"{name}.{w}" for w in _state_writes(ast.parse(_modules()[name].read_text()))]
    assert writes == []


def test_the_state_write_finder_finds_writes() -> None:
    code = """
def f(self):
    st = self.state
    st.auto_clear["p"] = ("t",)
    self.state.partition("p").set_tags([0], [{}])
    p = st.partitions["p"]
    p.consume("t", [0])
    return st.units
"""
    assert len(_state_writes(ast.parse(code))) == 3


def test_the_state_write_finder_follows_the_parts_of_the_shell() -> None:
    code = """
def f(self):
    self.shell.state.partition("p").consume("t", [0])
    p = self.core.state.partitions["p"]
    p.sealed = True
    return self.shell.state.units
"""
    assert len(_state_writes(ast.parse(code))) == 2


#: the client's modules, async and generated blocking: they share nothing private
CLIENT_MODULES = sorted(
    name for name in _modules() if name.startswith("_client") or name == "_transport._dealer"
)


def _private_imports(name: str, tree: ast.AST) -> list[str]:
    """``from ._x import _y`` (or ``from tq_async._x import _y``) in module ``name``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        if node.level or node.module.startswith(f"{PACKAGE}."):
            found += [
                f"{name} imports {node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_")
            ]
    return found


def test_no_private_name_is_imported_across_client_modules() -> None:
    found = []
    for name in CLIENT_MODULES:
        found += _private_imports(name, ast.parse(_modules()[name].read_text()))
    assert not found, "helpers live next to their only user, shared ones are public: " + str(found)


def test_the_private_import_finder_finds_them() -> None:
    code = """
from ._client_base import Links, _check_busy_poll
from tq_async._client._async._get import _copy_spans
from ._protocol import Hello
"""
    assert _private_imports("_client", ast.parse(code)) == [
        "_client imports _client_base._check_busy_poll",
        "_client imports tq_async._client._async._get._copy_spans",
    ]


def _client_classes() -> dict[str, str]:
    """Class name -> the client module that defines it."""
    return {
        node.name: name
        for name in CLIENT_MODULES
        for node in ast.walk(ast.parse(_modules()[name].read_text()))
        if isinstance(node, ast.ClassDef)
    }


def test_the_client_holds_its_parts_instead_of_inheriting_them() -> None:
    """httpcore's pool *holds* its connections: a client spread over modules by inheritance is
    one class in disguise. No client class derives from a class of another client module."""
    defined = _client_classes()
    inherited = []
    for name in CLIENT_MODULES:
        for node in ast.walk(ast.parse(_modules()[name].read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                base_name = ast.unparse(base).rsplit(".", 1)[-1]
                if defined.get(base_name, name) != name:
                    inherited.append(f"{name}.{node.name}({base_name} of {defined[base_name]})")
    assert not inherited, "hold the part as an attribute and delegate to it: " + str(inherited)


def test_the_client_checks_find_what_they_look_for() -> None:
    """The private-import and inheritance checks see the real client modules (a renamed module
    must not make them vacuous)."""
    assert {
        "_client._async._client",
        "_client._async._base",
        "_client._sync._client",
        "_client._sync._base",
    } <= set(CLIENT_MODULES)
    assert {"AsyncClient", "Client", "Links"} <= set(_client_classes())


def test_the_controller_holds_its_parts_instead_of_inheriting_them() -> None:
    """As the client: no class of the controller's shell derives from a class of another of
    its modules (the server holds the plumbing, the unit links and the paths as attributes)."""
    defined = {
        node.name: name
        for name in SHELL
        for node in ast.walk(ast.parse(_modules()[name].read_text()))
        if isinstance(node, ast.ClassDef)
    }
    assert {"ControllerServer", "Shell", "UnitLinks", "PutPath", "GetPath"} <= set(defined)
    inherited = [
        f"{name}.{node.name}({ast.unparse(base)})"
        for name in SHELL
        for node in ast.walk(ast.parse(_modules()[name].read_text()))
        if isinstance(node, ast.ClassDef)
        for base in node.bases
        if defined.get(ast.unparse(base).rsplit(".", 1)[-1], name) != name
    ]
    assert not inherited, "hold the part as an attribute and delegate to it: " + str(inherited)
