#!/usr/bin/env python3
"""Product functions longer than a limit, in every crate's `src`.

usage: scripts/long-functions.py [LIMIT] [CRATES_DIR]   (defaults: 120, crates)

A function's length is its lines from the `fn` line to its closing brace, counted by braces
outside strings, chars and comments. Test code is left out: `tests.rs` files, `tests/`
folders, and everything from a file's first `#[cfg(test)]` on (this workspace keeps its unit
tests at the end of a file). Prints `LINES path:line name` for each longer function, longest
first, then how many there are; exits 1 if any.
"""
import glob
import os
import re
import sys

FN = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)")


def code_lines(text):
    """The file's lines with strings, chars and comments blanked, so braces count true."""
    out, i, n = [], 0, len(text)
    buf = []
    depth_comment = 0
    while i < n:
        c = text[i]
        if depth_comment:
            if text.startswith("*/", i):
                depth_comment -= 1
                i += 2
                continue
            if text.startswith("/*", i):
                depth_comment += 1
                i += 2
                continue
            buf.append("\n" if c == "\n" else " ")
            i += 1
            continue
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            buf.append(" " * (j - i))
            i = j
            continue
        if text.startswith("/*", i):
            depth_comment = 1
            i += 2
            continue
        raw = re.match(r'r(#*)"', text[i:i + 10])
        if raw and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = text.find('"' + raw.group(1), i + len(raw.group(0)))
            end = n if end < 0 else end + 1 + len(raw.group(1))
            buf.append("".join("\n" if ch == "\n" else " " for ch in text[i:end]))
            i = end
            continue
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            buf.append("".join("\n" if ch == "\n" else " " for ch in text[i:j + 1]))
            i = j + 1
            continue
        if c == "'":
            char = re.match(r"'(\\.[^']*|[^\\'])'", text[i:i + 12])
            if char:
                buf.append(" " * len(char.group(0)))
                i += len(char.group(0))
                continue
        buf.append(c)
        i += 1
    return "".join(buf).split("\n")


def long_functions(path, limit):
    text = open(path, encoding="utf-8").read()
    cut = text.find("#[cfg(test)]")
    if cut >= 0:
        text = text[:cut]
    lines = code_lines(text)
    found = []
    for start, line in enumerate(lines):
        named = FN.match(line)
        if not named:
            continue
        depth, opened = 0, False
        for end in range(start, len(lines)):
            rest = lines[end]
            if not opened and ";" in rest and "{" not in rest:
                break  # a declaration without a body (a trait's)
            for ch in rest:
                if ch == "{":
                    depth += 1
                    opened = True
                elif ch == "}":
                    depth -= 1
            if opened and depth == 0:
                length = end - start + 1
                if length > limit:
                    found.append((length, f"{path}:{start + 1}", named.group(1)))
                break
    return found


def main():
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 120
    crates = sys.argv[2] if len(sys.argv) > 2 else "crates"
    found = []
    for path in sorted(glob.glob(os.path.join(crates, "*", "src", "**", "*.rs"), recursive=True)):
        if os.path.basename(path) == "tests.rs" or f"{os.sep}tests{os.sep}" in path:
            continue
        found += long_functions(path, limit)
    for length, where, name in sorted(found, reverse=True):
        print(f"{length:5} {where} {name}")
    print(f"{len(found)} function(s) longer than {limit} lines")
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
