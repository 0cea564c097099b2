"""Compare the machine code (SASS) of two builds of llmc's CUDA library, kernel by kernel: which kernels compile to
the same opcode sequence and which changed, with their instruction counts.

    python scripts/sass_diff.py OLD.so NEW.so [--match pipe_kernel] [--rename 'ELi0EEEv=EEEv'] [--json out.json]

A change that should leave some kernels alone can still change their code: on 2026-12-04, 64 bytes more of a
parameter struct every kernel takes made nvcc unroll every kernel's epilogue less (the 1-row fc + gate config 1,736 ->
1,360 instructions) and every int4 kernel 2-3 us slower on the H200 (docs/GPU_INT4_LOG.md). This names such kernels
without a GPU: it runs ``cuobjdump -sass`` (Triton's bundled copy unless ``--cuobjdump`` is given) on both files and
compares each kernel's opcodes (predicates, operands and addresses left out: parameter offsets move with the
parameters). ``--rename OLD=NEW`` maps a new build's kernel names back to the old ones (a kernel that gained a
template argument, e.g. ``ELi0EEEv=EEEv``). Exit status 1 when a kernel of the old build changed or is missing.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
FUNCTION = re.compile(r"Function : (\S+)")
PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def kernels(sass: str) -> dict[str, list[str]]:
    """``{mangled kernel name: [opcode, ...]}`` from ``cuobjdump -sass`` text (one instruction per addressed line;
    the encoding lines that follow carry no address)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        named = FUNCTION.search(line)
        if named:
            current = named.group(1)
            out[current] = []
        elif current is not None and ADDRESS.search(line):
            instruction = ADDRESS.split(line, maxsplit=1)[1].split(";")[0].strip()
            if instruction:
                out[current].append(PREDICATE.sub("", instruction).split()[0])
    return out


def compare(old: dict[str, list[str]], new: dict[str, list[str]], renames: list[tuple[str, str]] = (),
            match: str = "") -> dict:
    """Each old kernel (names containing ``match``) against the new kernel of its name (after ``renames`` on the new
    names): ``same`` (identical opcode sequences), ``changed`` (with instruction counts and the opcodes whose counts
    differ), ``missing``; ``added``: new kernels no old one maps to."""
    mapped: dict[str, str] = {}
    for name in new:
        old_name = name
        for a, b in renames:
            old_name = old_name.replace(a, b)
        mapped[old_name] = name
    report: dict = {"same": [], "changed": [], "missing": [], "added": []}
    for name, ops in sorted(old.items()):
        if match not in name:
            continue
        if name not in mapped:
            report["missing"].append(name)
        elif new[mapped[name]] == ops:
            report["same"].append(name)
        else:
            a, b = Counter(ops), Counter(new[mapped[name]])
            report["changed"].append({"kernel": name, "instructions": [len(ops), len(new[mapped[name]])],
                                      "opcodes": {k: [a[k], b[k]] for k in sorted(a.keys() | b.keys())
                                                  if a[k] != b[k]}})
    report["added"] = sorted(n for o, n in mapped.items() if o not in old and match in n)
    return report


def cuobjdump_path(given: str | None) -> str:
    if given:
        return given
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:  # no CUDA toolkit and no Triton: nothing here can read the library
        triton = None
    bundled = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump" if triton else None
    if bundled is None or not bundled.exists():
        raise SystemExit("cuobjdump not found: install the CUDA toolkit, or pass --cuobjdump PATH (Triton wheels "
                         "bundle one under triton/backends/nvidia/bin)")
    return str(bundled)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path, help="a build of the library (.so or .cubin)")
    ap.add_argument("new", type=Path, help="another build")
    ap.add_argument("--match", default="", help="only kernels whose mangled name contains this")
    ap.add_argument("--rename", action="append", default=[], metavar="NEW=OLD",
                    help="map part of a new kernel name to the old one (repeatable)")
    ap.add_argument("--cuobjdump", help="path of cuobjdump (default: PATH, then Triton's bundled copy)")
    ap.add_argument("--json", type=Path, help="write the whole report here")
    args = ap.parse_args()
    renames = []
    for item in args.rename:
        if "=" not in item:
            raise SystemExit(f"--rename {item!r}: give NEW=OLD, e.g. 'ELi0EEEv=EEEv'")
        renames.append(tuple(item.split("=", 1)))
    tool = cuobjdump_path(args.cuobjdump)
    sass = [subprocess.run([tool, "-sass", str(f)], capture_output=True, text=True, check=True).stdout
            for f in (args.old, args.new)]
    report = compare(kernels(sass[0]), kernels(sass[1]), renames, args.match)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"same {len(report['same'])}, changed {len(report['changed'])}, missing {len(report['missing'])}, "
          f"added {len(report['added'])}")
    for item in report["changed"][:20]:
        print(f"  changed {item['kernel'][:100]}: {item['instructions'][0]} -> {item['instructions'][1]}")
    for name in report["missing"][:20]:
        print(f"  missing {name[:100]}")
    sys.exit(1 if report["changed"] or report["missing"] else 0)


if __name__ == "__main__":
    main()
