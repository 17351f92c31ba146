#!/usr/bin/env python3
"""Functions in include/ longer than a limit (default 80 lines), longest first.

    scripts/function-lengths.py [LIMIT]

A function is a line ending in '{' that looks like a signature (a ')' or a trailing qualifier,
not a control statement, a namespace, a type or a lambda), up to its matching '}'; strings and
comments are ignored when braces are counted. A heuristic for C++ written in this project's
style (clang-format, braces at line ends), not a parser. A function that stays long says why in
its comment.
"""
import glob
import re
import sys

CONTROL = re.compile(r"^\s*(if|for|while|switch|else|do|try|catch|namespace|struct|class|union|enum)\b")


def strip(line):
    line = re.sub(r"//.*", "", line)
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    return re.sub(r"'(\\.|[^'\\])'", "''", line)


def long_functions(path, limit):
    lines = open(path).read().split("\n")
    i = 0
    while i < len(lines):
        text = lines[i].strip()
        signature = (text.endswith("{") and not CONTROL.match(lines[i]) and not text.startswith("//")
                     and (")" in text or "const" in text or "noexcept" in text)
                     and not text.startswith("[") and "= [" not in text and "](" not in text and "return [" not in text)
        if not signature:
            i += 1
            continue
        depth, j = 0, i
        for j in range(i, len(lines)):
            depth += strip(lines[j]).count("{") - strip(lines[j]).count("}")
            if depth <= 0:
                break
        length = j - i + 1
        if length > limit:
            yield length, path, i + 1, text
            i = j + 1
        else:
            i += 1


def main():
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 80
    found = []
    for path in sorted(glob.glob("include/**/*.hpp", recursive=True)):
        found.extend(long_functions(path, limit))
    for length, path, line, text in sorted(found, reverse=True):
        print(f"{length:4d} {path}:{line}  {text[:90]}")
    print(f"{len(found)} function(s) over {limit} lines")


if __name__ == "__main__":
    main()
