"""A copy of src/ for bench/relay_overhead.py's --variant: the working tree, with some files put
back as they are at a commit (``--revert PATH``, default HEAD), patches applied (``--patch FILE``)
and/or taken back out (``--unpatch FILE``: the tree without one's own change while others' changes
to the same file stay). Patches have a/src/… paths, as `git diff` writes them.

Run: python bench/variant.py OUT [--revert src/darkbloom/wire/protocol.py …] [--patch a.diff …] [--unpatch b.diff …]
then: python bench/relay_overhead.py --variant base=OUT
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_variant(out: Path, revert: list[str], patches: list[Path], unpatches: list[Path] = [],  # noqa: B006
                 commit: str = "HEAD") -> Path:
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(ROOT / "src", out, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for path in revert:
        rel = Path(path).relative_to("src")
        shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, check=True)
        (out / rel).write_bytes(shown.stdout)
    for diff in patches:
        subprocess.run(["patch", "-s", "-p2", "-d", str(out), "-i", str(diff.resolve())], check=True)
    for diff in unpatches:
        subprocess.run(["patch", "-s", "-R", "-p2", "-d", str(out), "-i", str(diff.resolve())], check=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--revert", action="append", default=[], metavar="PATH")
    parser.add_argument("--patch", action="append", default=[], type=Path, metavar="FILE")
    parser.add_argument("--unpatch", action="append", default=[], type=Path, metavar="FILE")
    parser.add_argument("--commit", default="HEAD")
    args = parser.parse_args()
    print(make_variant(args.out, args.revert, args.patch, args.unpatch, args.commit))


if __name__ == "__main__":
    main()
