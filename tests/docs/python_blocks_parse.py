"""Checks that every ```python block of a Markdown file is valid Python syntax.

The blocks are parsed, not run (they need TensorFlow or PyTorch).
Usage: python3 python_blocks_parse.py GUIDE.md
"""
import ast
import re
import sys


def main(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(r"^```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    if not blocks:
        print(f"{path}: no ```python blocks")
        return 1
    for number, block in enumerate(blocks, 1):
        try:
            ast.parse(block, filename=f"{path}, python block {number}")
        except SyntaxError as e:
            print(f"{e.filename}, line {e.lineno}: {e.msg}")
            return 1
    print(f"{path}: {len(blocks)} python blocks parse")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
