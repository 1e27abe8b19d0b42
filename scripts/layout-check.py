#!/usr/bin/env python3
"""The code's layout rules, checked: exit 1 and name what breaks them, else 0.

1. No import cycle between the modules (files) of a crate.
2. No test-only code inside production code: a `#[cfg(test)]` may stand before an item (a test
   module, a test helper function) but not before a statement, a match arm, an enum variant or a
   field, where it makes the production code take another branch in tests (the in-memory doubles
   come in through the platform's traits instead: crates/mpquic/src/io/platform.rs).

Cycles:

A file's imports are the crate paths it names, in `use` lines or inline (`crate::a::b`,
`super::c`, `self::d`), each resolved to the longest module path with a file of its own. A
module's own children and its parent's declarations (`mod x;`) are not imports. Run by
scripts/test.sh; `python3 scripts/layout-check.py --graph` prints every edge.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = ["crates/core/src", "crates/mpquic/src", "crates/status/src", "crates/lab/src",
          "crates/linkmodel/src"]
PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")
GROUP = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)*)::\{([^{}]*)\}", re.S)


def modules(src):
    """Module path (tuple) -> file, for every .rs file under `src`."""
    out = {}
    for d, _, files in os.walk(src):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(d, f), src)[:-3].split(os.sep)
            if rel[-1] in ("lib", "main", "mod"):
                rel = rel[:-1]
            out[tuple(rel)] = os.path.join(d, f)
    return out


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(l.split("//", 1)[0] for l in text.splitlines())


def test_free(text):
    """The text without `#[cfg(test)] mod tests { ... }` blocks (tests may reach anywhere)."""
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*mod\s+\w+\s*\{", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    out.append(text[i:])
    return "".join(out)


def resolve(me, kind, parts, mods):
    """The module a path in module `me` names (longest prefix with a file), or None."""
    if kind == "crate":
        base = []
    elif kind == "self":
        base = list(me)
    else:
        base = list(me[:-1])
    full = base + parts
    for n in range(len(full), -1, -1):
        if tuple(full[:n]) in mods:
            return tuple(full[:n])
    return None


def edges(mods):
    out = {m: set() for m in mods}
    for me, path in mods.items():
        text = test_free(strip_comments(open(path).read()))
        found = []
        for g in GROUP.finditer(text):
            prefix = [p for p in g.group(2).split("::") if p]
            for item in g.group(3).split(","):
                item = item.strip().split(" as ")[0].strip()
                if item and item != "self":
                    found.append((g.group(1), prefix + item.split("::")))
                elif item == "self":
                    found.append((g.group(1), prefix))
        for p in PATH.finditer(text):
            found.append((p.group(1), [x for x in p.group(2).split("::") if x]))
        for kind, parts in found:
            to = resolve(me, kind, parts, mods)
            # A module and its own descendants (declared by it) are one unit here.
            if to is None or to == me or to[:len(me)] == me or me[:len(to)] == to:
                continue
            out[me].add(to)
    return out


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


ITEM = re.compile(r"\s*(pub\b|fn\b|async\b|mod\b|struct\b|enum\b|impl\b|use\b|const\b|static\b|type\b|trait\b|#\[|macro_rules!)")


def test_branches(path):
    """`#[cfg(test)]` lines (1-based) of a file that stand before something other than an item."""
    lines = strip_comments(open(path).read()).split("\n")
    out = []
    for n, line in enumerate(lines):
        if line.strip() != "#[cfg(test)]":
            continue
        after = next((l for l in lines[n + 1:] if l.strip()), "")
        if not ITEM.match(after):
            out.append(n + 1)
    return out


def main():
    bad = 0
    for crate in CRATES:
        mods = modules(os.path.join(ROOT, crate))
        for path in sorted(mods.values()):
            for n in test_branches(path):
                bad += 1
                print(f"{os.path.relpath(path, ROOT)}:{n}: #[cfg(test)] inside production code")
        graph = edges(mods)
        if "--graph" in sys.argv:
            for a in sorted(graph):
                for b in sorted(graph[a]):
                    print(f"{crate}: {'::'.join(a) or 'lib'} -> {'::'.join(b) or 'lib'}")
        for comp in cycles(graph):
            bad += 1
            names = ", ".join(sorted("::".join(c) or "lib" for c in comp))
            print(f"{crate}: import cycle between {names}")
    if not bad:
        print(f"{len(CRATES)} crates: no import cycle between modules, no test-only branch in production code")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
