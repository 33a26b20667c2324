#!/usr/bin/env python3
"""Print the GPU stack's pins from their one source (``pyproject.toml``'s extras).

    python tools/pins.py                        # table: package, version, extra, how it is installed
    python tools/pins.py --group resolved       # name==version lines for pip (Dockerfile: -r)
    python tools/pins.py --group no-deps --out /tmp/no-deps.txt
    python tools/pins.py --platform python      # 3.12 ([tool.nemo_fp8.container])
    python tools/pins.py --base-deps            # the project's own (unpinned) dependencies, for pip -r
    python tools/pins.py --check-installed      # exit 1 unless every pin is installed at its version
    bash ../shared/gpu-host/stage.sh $(python tools/pins.py --stage)   # pins the host's set lacks
    python tools/pins.py --extra sglang         # one extra's pins, name==version on one line (staged apart)

Standard library only (runs in the Dockerfile's builder before anything is installed, with the checkout on
``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from nemo_fp8.utils.pins import (container_platform, extra_pins, install_groups, read_pyproject,
                                 read_requirements_file, stack_pins)

# Provided on the GPU host without staging: torch and transformers by its image, the TE torch
# extension by ../shared/gpu-host/wheels/ (built there against torch 2.11.0+cu130).
HOST_PROVIDED = ("torch", "transformers", "transformer-engine-torch")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pyproject", default=str(REPO / "pyproject.toml"))
    ap.add_argument("--group", choices=["resolved", "no-deps", "build", "all"],
                    help="print name==version lines of one install group")
    ap.add_argument("--platform", choices=["python", "cuda"], help="print the container's Python or CUDA version")
    ap.add_argument("--base-deps", action="store_true", help="print [project.dependencies], one a line")
    ap.add_argument("--check-installed", action="store_true",
                    help="exit 1 unless every pin is installed at exactly its version")
    ap.add_argument("--stage", action="store_true",
                    help="print the pins that ../shared/gpu-host/requirements.txt lacks (extra args for stage.sh)")
    ap.add_argument("--host-requirements", default=str(REPO.parent / "shared" / "gpu-host" / "requirements.txt"))
    ap.add_argument("--extra", help="print one extra's pins (e.g. sglang, outside the stack) as name==version words")
    ap.add_argument("--out", help="write to this file instead of stdout")
    args = ap.parse_args(argv)

    pins = stack_pins(args.pyproject)
    if args.check_installed:
        from importlib import metadata
        bad = []
        for p in pins:
            try:
                have = metadata.version(p.name)
            except metadata.PackageNotFoundError:
                have = None
            if have is None or have.split("+")[0] != p.version:
                bad.append(f"{p.name}: pinned {p.version}, installed {have or 'nothing'}")
        print("\n".join(bad) if bad else f"all {len(pins)} pins installed at their versions")
        return 1 if bad else 0
    if args.extra:
        try:
            text = " ".join(str(p) for p in extra_pins(args.pyproject, args.extra)) + "\n"
        except KeyError as e:
            ap.error(str(e.args[0]))
    elif args.base_deps:
        text = "".join(f"{d}\n" for d in read_pyproject(args.pyproject)["project"]["dependencies"])
    elif args.platform:
        text = container_platform(args.pyproject)[args.platform] + "\n"
    elif args.stage:
        if not Path(args.host_requirements).is_file():
            ap.error(f"{args.host_requirements} not found (pass --host-requirements)")
        host = read_requirements_file(args.host_requirements)
        text = " ".join(str(p) for p in pins if p.name not in HOST_PROVIDED and host.get(p.name) != p.version)
        text += "\n" if text else ""
    elif args.group:
        chosen = pins if args.group == "all" else install_groups(pins)[args.group]
        text = "".join(f"{p}\n" for p in chosen)
    else:
        groups = {p.name: g for g, ps in install_groups(pins).items() for p in ps}
        rows = [("package", "version", "extra", "install")] + [
            (p.name, p.version or "-", p.extra, groups[p.name]) for p in pins]
        w = [max(len(r[i]) for r in rows) for i in range(4)]
        text = "".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)).rstrip() + "\n" for r in rows)
    if args.out:
        Path(args.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
