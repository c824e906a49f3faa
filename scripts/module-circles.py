#!/usr/bin/env python3
"""Import circles among the module files of each crate.

usage: scripts/module-circles.py [CRATES_DIR]   (default: crates)

A file depends on another when its code (comments and `#[cfg(test)]` modules left out) names
`crate::x…` or `super::x…` resolving to that module's file. Prints every strongly connected
component of two files or more, one line each, then how many there are; exits 1 if any.
"""
import glob
import os
import re
import sys

PATH = re.compile(r"\b(crate|super)::(\{[^;]*?\}|[A-Za-z_][A-Za-z0-9_:]*)", re.S)


def module_of(src, path):
    parts = os.path.relpath(path, src)[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def code_of(path):
    text = open(path, encoding="utf-8").read()
    cut = text.find("#[cfg(test)]")
    if cut >= 0:
        text = text[:cut]
    return "\n".join(l for l in text.split("\n") if not l.lstrip().startswith("//"))


def named_paths(body):
    """`a::b` or the items of `{a::b, c::{d, e}}`, each as its leading path."""
    if not body.startswith("{"):
        return [body]
    items = re.split(r",(?![^{]*\})", body[1:-1])
    return [re.split(r"::\{", item.strip())[0] for item in items if item.strip()]


def dependencies(src, modules):
    edges = {module: set() for module in modules}
    for module, path in modules.items():
        # `super` of a file is its directory's module; of a mod.rs, the directory above.
        parent = module[:-1]
        for found in PATH.finditer(code_of(path)):
            base = () if found.group(1) == "crate" else parent
            for named in named_paths(found.group(2)):
                segments = [s for s in named.split("::") if s and s != "self"]
                for k in range(len(segments), 0, -1):
                    target = base + tuple(segments[:k])
                    if target in modules:
                        if target not in (module, ()):
                            edges[module].add(target)
                        break
    return edges


def circles(edges):
    """Tarjan's strongly connected components of more than one node."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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
                found.append(component)

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return found


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "crates"
    total = 0
    for crate in sorted(glob.glob(os.path.join(root, "*"))):
        src = os.path.join(crate, "src")
        if not os.path.isdir(src):
            continue
        files = glob.glob(os.path.join(src, "**", "*.rs"), recursive=True)
        modules = {module_of(src, path): path for path in files}
        for component in circles(dependencies(src, modules)):
            total += 1
            names = " <-> ".join("/".join(m) or "lib" for m in component)
            print(f"{os.path.basename(crate)}: {names}")
    print(f"circles: {total}")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
