"""Command line: `python -m foldkv aot build --arch sm_90a --out DIR` and `python -m foldkv aot verify DIR`."""

from __future__ import annotations

import argparse
import json
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m foldkv", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    aot = sub.add_parser("aot", help="ahead-of-time kernels: build cubins + manifest, or verify a build")
    aot_sub = aot.add_subparsers(dest="aot_command", required=True)

    b = aot_sub.add_parser("build", help="generate every registered kernel, compile it with nvcc, write a manifest")
    b.add_argument("--arch", default="sm_90a", help="SM target, e.g. sm_90a (default)")
    b.add_argument("--out", required=True, help="output folder (replaced if it holds a previous build)")
    b.add_argument("--geometry", default=None,
                   help="preset name or config.json path the kernels are specialised for (default: gemma-4-31b)")
    b.add_argument("--only", action="append", default=None, metavar="NAME",
                   help="build only this registered variant (repeatable)")

    v = aot_sub.add_parser("verify", help="check a build folder against its manifest (hashes, files, barrier check)")
    b.add_argument("--fill-tilelang-cache", action="store_true",
                   help="also save each kernel in TileLang's disk cache (start from an empty TILELANG_CACHE_DIR), so a"
                        " JIT process using that cache runs exactly these cubins")
    v.add_argument("dir")
    v.add_argument("--json", action="store_true", help="print the manifest summary as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "aot" and args.aot_command == "build":
        from .aot.build import AotBuildError, build
        from .kernels import registry

        variants = None
        if args.only:
            variants = [registry.get(n) for n in args.only]
        try:
            manifest = build(args.out, arch=args.arch, geometry=args.geometry, variants=variants,
                             log=lambda s: print(s, file=sys.stderr), fill_tilelang_cache=args.fill_tilelang_cache)
        except AotBuildError as exc:
            print(f"aot build failed: {exc}", file=sys.stderr)
            return 1
        print(f"{len(manifest['kernels'])} kernels for {manifest['arch']} ({', '.join(manifest['formats']) or 'no format'})"
              f" in {args.out}")
        return 0
    if args.command == "aot" and args.aot_command == "verify":
        from .aot.verify import AotVerifyError, summary, verify

        try:
            manifest = verify(args.dir)
        except AotVerifyError as exc:
            print(str(exc), file=sys.stderr)
            return 1
        s = summary(manifest)
        print(json.dumps(s, indent=1) if args.json else f"ok: {len(s['kernels'])} kernels match the manifest in {args.dir}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
