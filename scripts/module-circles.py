#!/usr/bin/env python3
"""Circles among the module files of each crate: an edge a -> b when file a names `crate::b…`
or `super::b…` (in a use or a path) resolving to module file b. Prints each strongly connected
component of more than one file."""
import os, re, sys, glob
root = sys.argv[1] if len(sys.argv) > 1 else "crates"
def module_of(crate_src, path):
    rel = os.path.relpath(path, crate_src)[:-3]
    parts = rel.split(os.sep)
    if parts[-1] in ("mod", "lib", "main"): parts = parts[:-1]
    return tuple(parts)
total = 0
for crate in sorted(glob.glob(os.path.join(root, "*"))):
    src = os.path.join(crate, "src")
    if not os.path.isdir(src): continue
    files = [p for p in glob.glob(os.path.join(src, "**", "*.rs"), recursive=True)]
    mods = {module_of(src, p): p for p in files}
    edges = {m: set() for m in mods}
    for m, p in mods.items():
        text = open(p).read()
        # strip test modules
        cut = text.find("#[cfg(test)]")
        if cut >= 0: text = text[:cut]
        text = "\n".join(l for l in text.split("\n") if not l.lstrip().startswith("//"))
        is_dir_mod = os.path.basename(p) in ("mod.rs", "lib.rs", "main.rs")
        parent = m if is_dir_mod else m[:-1]
        # expand use crate::{a, b::c}
        for mm in re.finditer(r"\b(crate|super)::(\{[^;]*?\}|[A-Za-z_][A-Za-z0-9_:]*)", text, re.S):
            base = () if mm.group(1) == "crate" else (parent[:-1] if is_dir_mod else parent[:-1]) if False else None
            if mm.group(1) == "crate": base = ()
            else: base = m[:-1] if not is_dir_mod else m[:-1]
            body = mm.group(2)
            paths = []
            if body.startswith("{"):
                for item in re.split(r",(?![^{]*\})", body[1:-1]):
                    item = item.strip()
                    if item: paths.append(re.split(r"::\{", item)[0])
            else:
                paths.append(body)
            for path in paths:
                segs = [s for s in path.split("::") if s and s != "self"]
                # longest prefix that is a module
                target = None
                for k in range(len(segs), 0, -1):
                    cand = base + tuple(segs[:k])
                    if cand in mods: target = cand; break
                if target and target != m and not (target == () ):
                    edges[m].add(target)
    # Tarjan
    index = {}; low = {}; stack = []; on = set(); sccs = []; i = [0]
    sys.setrecursionlimit(10000)
    def strong(v):
        index[v] = low[v] = i[0]; i[0] += 1; stack.append(v); on.add(v)
        for w in edges[v]:
            if w not in index: strong(w); low[v] = min(low[v], low[w])
            elif w in on: low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v: break
            if len(comp) > 1: sccs.append(comp)
    for v in mods:
        if v not in index: strong(v)
    for comp in sccs:
        total += 1
        print(os.path.basename(crate), ": ", " <-> ".join("/".join(c) or "lib" for c in comp))
print("circles:", total)
