#!/usr/bin/env python3
"""Writes fsdp.h from src/: the parts that src/parts.txt lists, in its order.

    python3 tools/amalgamate.py              write fsdp.h
    python3 tools/amalgamate.py -o FILE      write FILE instead
    python3 tools/amalgamate.py --check      fail (exit 1) when the committed
                                             fsdp.h is not what src/ gives

fsdp.h is what users copy; src/ is where the library is written (see
CONTRIBUTING.md). Python's standard library only.
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src")


def read_parts(src=SRC):
    """The part names of src/parts.txt, in order."""
    names = []
    with open(os.path.join(src, "parts.txt"), encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                names.append(line)
    return names


def read_part(name, src=SRC):
    with open(os.path.join(src, name), encoding="utf-8", newline="") as f:
        text = f.read()
    if text and not text.endswith("\n"):
        raise SystemExit("amalgamate: src/%s does not end with a newline" % name)
    return text


def banner(name):
    """The line before a part in fsdp.h, naming its file (the first part,
    the manual, has none: fsdp.h's first line is its title)."""
    return "/* ---- src/%s (fsdp.h is generated: edit this file) ---- */\n" % name


def amalgamate(src=SRC):
    """fsdp.h's text, and for each of its lines the part it came from:
    a list of (first line in fsdp.h, part name, lines); a part's banner
    is its line 0."""
    out, where, line = [], [], 1
    for k, name in enumerate(read_parts(src)):
        text = read_part(name, src)
        if k:
            out.append(banner(name))
            line += 1
        n = text.count("\n")
        where.append((line, name, n))
        out.append(text)
        line += n
    return "".join(out), where


def locate(where, line):
    """The part and the line inside it of fsdp.h's line `line`."""
    for first, name, n in where:
        if first - 1 <= line < first + n:
            return name, line - first + 1
    return None, None


def check(path, text, where):
    try:
        with open(path, encoding="utf-8", newline="") as f:
            have = f.read()
    except OSError as e:
        print("amalgamate: cannot read %s: %s" % (path, e.strerror))
        return 1
    if have == text:
        return 0
    a, b = have.split("\n"), text.split("\n")
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    name, at = locate(where, k + 1)
    print("amalgamate: %s differs from what src/ gives, first at its line %d%s." %
          (os.path.relpath(path, ROOT), k + 1,
           " (src/%s:%d)" % (name, at) if name else " (past the last part)"))
    print("  committed: %r" % (a[k] if k < len(a) else "<end of file>"))
    print("  from src/: %r" % (b[k] if k < len(b) else "<end of file>"))
    print("fsdp.h is generated: edit src/..., then run tools/amalgamate.py "
          "(never edit fsdp.h by hand; CONTRIBUTING.md)")
    return 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default=os.path.join(ROOT, "fsdp.h"),
                    help="the file to write (default: fsdp.h)")
    ap.add_argument("--check", action="store_true",
                    help="compare with the output file instead of writing it")
    args = ap.parse_args(argv)
    text, where = amalgamate()
    if args.check:
        return check(args.output, text, where)
    tmp = args.output + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    os.replace(tmp, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
