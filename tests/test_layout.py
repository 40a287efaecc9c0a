"""The package's structure, read from its source (docs/implementations.md, "Where things are"):

- what a save ships as remote code is exactly the flat modules at the package's root, the ones the model file
  imports, and none of them builds code, takes locks, uploads, changes directory or imports the installed package;
- no import cycle between the project's modules, counting imports inside functions;
- no module imports another module's private name;
- comments and docstrings describe the code as it is: no Python file cites a round or an issue.
"""

import ast
import re
import subprocess
from pathlib import Path

import pytest

from modeling_dcformer import publishing

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "modeling_dcformer"
# The folders the package installs, by their import name (setup.cfg's package_dir)
INSTALLED = {"modeling_dcformer": PACKAGE, "modeling_dcformer.configuration": ROOT / "configuration",
             "modeling_dcformer.conversion": ROOT / "conversion", "modeling_dcformer.evals": ROOT / "evals"}
RESEARCH = {"dcformer_research": ROOT / "research" / "dcformer_research"}
# What a save's remote code must not do: build native code, take file locks, talk to the Hub, change directory
FORBIDDEN_MODULES = ("torch.utils.cpp_extension", "ctypes", "filelock")
FORBIDDEN_NAMES = {"huggingface_hub": {"HfApi", "upload_folder", "upload_file", "create_repo", "create_commit"}}


def modules(roots: dict[str, Path]) -> dict[str, Path]:
    """Every module of the folders `roots` (import name -> root folder), by its dotted name."""
    found = {}
    for package, folder in roots.items():
        for path in folder.rglob("*.py"):
            if "results" in path.relative_to(folder).parts:
                continue
            parts = [*package.split("."), *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every import statement of the module `name`, at any depth (inside functions
    too), relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = node.module if node.level == 0 else ".".join(p for p in (base, node.module) if p)
            found.append((module, [alias.name for alias in node.names]))
    return found


def import_graph(roots: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports (`from package import module` counts as importing that module)."""
    known = modules(roots)
    graph = {}
    for name, path in known.items():
        edges = set()
        for module, names in imports_of(name, path):
            for target in [f"{module}.{n}" for n in names if f"{module}.{n}" in known] or [module]:
                if target in known and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules in order), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


SHIPPED = sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
SHIPPED_NAMES = {f"modeling_dcformer.{p.stem}" for p in SHIPPED}


def test_a_save_ships_exactly_the_flat_modules_the_model_imports(tmp_path):
    """The flat modules at the package's root are the remote code: the model file and its relative imports, which
    transformers copies into a save (everything else of the package lives in a folder named by its role)."""
    assert {p.name for p in publishing.remote_code_files()} == {p.name for p in SHIPPED}
    from modeling_dcformer import DCFormerConfig, DCFormerForCausalLM

    config = DCFormerConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32)  # fmt: skip
    DCFormerForCausalLM(config).save_pretrained(tmp_path / "saved")
    assert {p.name for p in (tmp_path / "saved").glob("*.py")} == {p.name for p in SHIPPED}


def remote_code_violations(name: str, path: Path) -> list[str]:
    """What the module `name` at `path` does that remote code must not."""
    found = []
    for module, names in imports_of(name, path):
        if module.startswith(FORBIDDEN_MODULES):
            found.append(f"imports {module}")
        if set(names) & FORBIDDEN_NAMES.get(module, set()):
            found.append(f"imports {sorted(set(names) & FORBIDDEN_NAMES[module])} from {module}")
        targets = [f"{module}.{n}" for n in names] if module == "modeling_dcformer" else [module]
        for target in targets:  # the package's own modules: only the flat ones, which the save carries too
            if target.partition(".")[0] == "modeling_dcformer" and target not in SHIPPED_NAMES:
                found.append(f"imports {target}, which a save does not carry")
    for node in ast.walk(ast.parse(path.read_text())):
        called = node.func if isinstance(node, ast.Call) else None
        if isinstance(called, ast.Attribute) and called.attr in ("chdir", "import_module"):
            found.append(f"calls {called.attr}")
        if isinstance(called, ast.Name) and called.id == "__import__":
            found.append("calls __import__")
    return found


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_the_shipped_modules_import_nothing_that_builds_locks_uploads_or_moves(path):
    """Remote code runs where only torch and transformers are: no native builds (cpp_extension, ctypes), no file
    locks, no uploads, no `os.chdir`, no import of the installed package (its additions reach the flat modules
    through `configuration_dcformer.PACKAGE`), nothing imported by a name in a string."""
    assert remote_code_violations(f"modeling_dcformer.{path.stem}", path) == []


def test_the_layout_checks_can_fail(tmp_path):
    """The checks above, on a module that breaks each rule, and on a cycle."""
    bad = tmp_path / "bad.py"
    bad.write_text("import ctypes, os\nfrom .kernels import build\nfrom . import modeling_dcformer, publishing\n"
                   "from huggingface_hub import HfApi, hf_hub_download\n"
                   "def f():\n    import filelock\n    os.chdir('/')\n    __import__('x')\n")
    assert set(remote_code_violations("modeling_dcformer.bad", bad)) == {
        "imports ctypes", "imports modeling_dcformer.kernels, which a save does not carry",
        "imports modeling_dcformer.publishing, which a save does not carry",
        "imports ['HfApi'] from huggingface_hub", "imports filelock", "calls chdir", "calls __import__"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
    """No two of the project's modules import each other, directly or through others, even inside functions."""
    assert find_cycle(import_graph({**INSTALLED, **RESEARCH})) is None


def test_no_module_imports_another_modules_private_name():
    """A name with a leading underscore stays in its module: another module that needs it gets a public name."""
    known = modules({**INSTALLED, **RESEARCH})
    for name, path in known.items():
        for module, names in imports_of(name, path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            assert not (private and module.split(".")[0] in ("modeling_dcformer", "dcformer_research")), (
                f"{name} imports {private} from {module}")


def test_no_python_file_cites_a_round_or_an_issue():
    """Comments and docstrings describe the code as it is; the history is git's."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    cited = re.compile(r"round [0-9]+|issue [0-9]+", re.IGNORECASE)  # as `git grep -E` reads it, inside words too
    found = [f"{name}:{number}: {line.strip()}" for name in files.stdout.split()
             for number, line in enumerate((ROOT / name).read_text().splitlines(), 1) if cited.search(line)]
    assert not found, "\n".join(found[:20])
