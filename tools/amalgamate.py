#!/usr/bin/env python3
"""Writes fsdp.h from src/: the parts that src/parts.txt lists, in its order.

    python3 tools/amalgamate.py              write fsdp.h
    python3 tools/amalgamate.py -o FILE      write FILE instead
    python3 tools/amalgamate.py --check      fail (exit 1) when the committed
                                             fsdp.h is not what src/ gives
    python3 tools/amalgamate.py --layers CC [CC ...]
                                             compile each part with only the
                                             parts before it, with each CC

The layering rule as a compiler fact (--layers): a declarations part
(before decl_end.h) compiles after the declarations before it, an
implementation part (after impl_begin.c) after everything before it, each with -std=c11 -Wall -Wextra -Wpedantic
-Werror -fsyntax-only. A part that needs a later one fails to compile.
Forward declarations live in the section's internal header
(src/SECTION_internal.h, the section's first implementation part).

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


# -Wno-unused-function: a prefix holds its section's internal header, whose
# declarations the later parts define; a call to one of them before its
# part is still refused ("used but never defined", -Wundefined-internal).
FLAGS = ["-std=c11", "-Wall", "-Wextra", "-Wpedantic", "-Werror", "-Wno-unused-function",
         "-fsyntax-only", "-ffp-contract=off", "-x", "c"]


def layers(compilers, src=SRC, jobs=2):
    """Compiles every prefix of the parts that ends with a part, with each
    compiler; returns the number of failures (each printed)."""
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    names = read_parts(src)
    texts = {n: read_part(n, src) for n in names}
    close_decl = "decl_end.h"
    begin_impl = "impl_begin.c"
    close_impl = "impl_end.c"
    for n in (close_decl, begin_impl, close_impl):
        if n not in texts:
            raise SystemExit("amalgamate: src/parts.txt has no %s" % n)
    units = []
    decl = True  # parts before decl_end.h are declarations
    for k, name in enumerate(names):
        if name == close_decl:
            decl = False
        if name in (close_decl, begin_impl, close_impl) or k == 0:
            continue
        before = names[:k + 1]
        if decl:
            body = "".join(texts[n] for n in before) + texts[close_decl]
            units.append((name, "", body))
        elif close_impl in before:  # after the implementation: the whole file
            units.append((name, "#define FSDP_IMPLEMENTATION\n", "".join(texts[n] for n in before)))
        else:
            body = "".join(texts[n] for n in before) + texts[close_impl]
            units.append((name, "#define FSDP_IMPLEMENTATION\n", body))
    tmp = tempfile.mkdtemp(prefix="fsdp-layers-")
    jobs_list = []
    for cc in compilers:
        for name, pre, body in units:
            jobs_list.append((cc, name, pre + body))

    def run(job):
        cc, name, text = job
        path = os.path.join(tmp, "%s.%s.c" % (os.path.basename(cc), name.replace(".", "_")))
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        p = subprocess.run([cc] + FLAGS + [path], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, universal_newlines=True)
        os.unlink(path)
        return cc, name, p.returncode, p.stdout

    failed = 0
    with ThreadPoolExecutor(max_workers=jobs) as ex:
        for cc, name, rc, out in ex.map(run, jobs_list):
            if rc != 0:
                failed += 1
                print("layers: FAIL %s: src/%s does not compile with only the parts before it" %
                      (cc, name))
                print("\n".join(out.splitlines()[:20]))
    os.rmdir(tmp)
    print("layers: %d parts, %d compilers: %d passed, %d failed" %
          (len(units), len(compilers), len(jobs_list) - failed, failed))
    return failed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default=os.path.join(ROOT, "fsdp.h"),
                    help="the file to write (default: fsdp.h)")
    ap.add_argument("--check", action="store_true",
                    help="compare with the output file instead of writing it")
    ap.add_argument("--layers", nargs="+", metavar="CC",
                    help="compile each part with only the parts before it, with these compilers")
    ap.add_argument("-j", "--jobs", type=int, default=2, help="compiles at once (--layers)")
    args = ap.parse_args(argv)
    if args.layers:
        return 1 if layers(args.layers, jobs=args.jobs) else 0
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
