#!/usr/bin/env python3
"""The manual cannot drift from its program: every code line that README.md
(sections "The heart of a training loop" and "Save and resume") and the
STEP BY STEP of fsdp.h's manual show (steps 1 to 7) is a line of
examples/hello_fsdp.c, which the test command builds and runs.
Usage: check_manual.py REPO_ROOT"""
import re
import sys

root = sys.argv[1]
example = [l.rstrip() for l in open(root + "/examples/hello_fsdp.c")]
stripped = set(l.strip() for l in example)
bad = 0
checked = 0

readme = open(root + "/README.md").read()
for section in ["The heart of a training loop", "Save and resume"]:
    m = re.search(r"^## " + re.escape(section) + r"\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    if not m:
        print("FAIL: README.md has no section '%s'" % section)
        bad += 1
        continue
    blocks = re.findall(r"```c\n(.*?)```", m.group(1), re.S)
    if not blocks:
        print("FAIL: README.md's '%s' shows no C code" % section)
        bad += 1
    for block in blocks:
        for line in block.splitlines():
            if not line.strip() or line.strip() == "...":
                continue
            checked += 1
            if line.rstrip() not in example:
                print("FAIL: README.md (%s): not a line of hello_fsdp.c: %r" % (section, line))
                bad += 1

top = open(root + "/fsdp.h").read().split("#ifndef FSDP_H_INCLUDED")[0]
heading = re.search(r"^ *STEP BY STEP\n *=+\n", top, re.M)
if not heading or "8. Several ranks" not in top[heading.end():]:
    print("FAIL: fsdp.h's manual has no STEP BY STEP heading with steps 1 to 8")
    bad += 1
else:
    steps = top[heading.end():].split("8. Several ranks", 1)[0]
    n = 0
    for line in steps.splitlines():
        # code is indented 10 or more spaces; prose 3 to 6
        if len(line) - len(line.lstrip()) >= 10 and line.strip() and line.strip() != "...":
            n += 1
            if line.strip() not in stripped:
                print("FAIL: fsdp.h STEP BY STEP: not a line of hello_fsdp.c: %r" % line)
                bad += 1
    if n < 20:
        print("FAIL: fsdp.h's STEP BY STEP shows only %d code lines" % n)
        bad += 1
    checked += n

print("%d code lines of the README and the manual checked against hello_fsdp.c, %d not in it"
      % (checked, bad))
sys.exit(1 if bad else 0)
