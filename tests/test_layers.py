"""hetforge's packages form layers: none imports one above it, at module level or inside a
function, so there is no import cycle between packages (a lazy import that closes one only hides
it until run time)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "hetforge"

# Bottom up; a package may import its own floor and those below it.
LAYERS = [
    {"core"},
    {"model"},
    {"config"},
    {"data"},
    {"memory"},
    {"cluster"},
    {"evaluate", "scaling"},
    {"train"},
    {"export"},
    {"cli", "__main__"},
]
FLOOR = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "hetforge":
        return None
    return parts[1] if len(parts) > 1 else "core"  # `from hetforge import __version__`: the root is bottom


def imports() -> list[tuple[str, str, str, int]]:
    """(importing package, imported package, file, line) for every import, wherever it stands."""
    out = []
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT).with_suffix("")
        src = rel.parts[0] if len(rel.parts) > 1 else rel.parts[0]
        if src == "__init__":
            src = "core"
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                dst = package_of(name)
                if dst is not None and dst != src:
                    out.append((src, dst, str(rel), node.lineno))
    return out


def test_every_package_has_a_floor():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    assert packages <= set(FLOOR), f"packages without a layer: {sorted(packages - set(FLOOR))}"


def test_no_package_imports_one_above_it():
    upward = [f"{file}:{line} ({src} imports {dst})" for src, dst, file, line in imports()
              if FLOOR[dst] > FLOOR[src]]
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_no_import_cycle_between_packages():
    edges: dict[str, set[str]] = {}
    for src, dst, _, _ in imports():
        edges.setdefault(src, set()).add(dst)

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        for n in edges.get(a, ()):
            if n == b or (n not in seen and (seen.add(n) or reaches(n, b, seen))):
                return True
        return False

    cycles = sorted(p for p in edges if reaches(p, p, set()))
    assert not cycles, f"packages on an import cycle: {cycles}"


def test_the_check_sees_function_level_imports(tmp_path, monkeypatch):
    """The checker itself: an import inside a function counts."""
    pkg = tmp_path / "hetforge"
    (pkg / "core").mkdir(parents=True)
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "core" / "x.py").write_text("def f():\n    from hetforge.train.loop import train\n")
    import sys

    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    assert ("core", "train", "core/x", 2) in imports()
