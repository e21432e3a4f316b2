"""Command line: `python -m foldkv aot build --arch sm_90a --out DIR` and `python -m foldkv aot verify DIR`. Misuse
exits 2 the argparse way before anything is generated; a build or verify that fails says why and exits 1."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys


def _sm_arch(value: str) -> str:
    from .aot.build import SM_ARCH

    if not re.fullmatch(SM_ARCH, value):
        raise argparse.ArgumentTypeError(f"{value!r} is not an SM token such as 'sm_90a'")
    return value


def _parser() -> argparse.ArgumentParser:
    from .kernels.tl import DEFAULT_ARCH

    p = argparse.ArgumentParser(prog="python -m foldkv", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    aot = sub.add_parser("aot", help="ahead-of-time kernels: build cubins + manifest, or verify a build")
    aot_sub = aot.add_subparsers(dest="aot_command", required=True)

    b = aot_sub.add_parser("build", help="generate every registered kernel, compile it with nvcc, write a manifest")
    b.add_argument("--arch", type=_sm_arch, default=DEFAULT_ARCH,
                   help=f"SM target the kernel builders generate for (default {DEFAULT_ARCH}, from FOLDKV_CUDA_ARCH or"
                        " sm_90a; another arch needs FOLDKV_CUDA_ARCH set to it)")
    b.add_argument("--out", required=True, help="output folder (replaced if it holds a previous build)")
    b.add_argument("--geometry", default=None,
                   help="preset name or config.json path the kernels are specialised for (default: gemma-4-31b)")
    b.add_argument("--only", action="append", default=None, metavar="NAME",
                   help="build only this registered variant (repeatable)")
    b.add_argument("--fill-tilelang-cache", action="store_true",
                   help="also save each kernel in TileLang's disk cache (start from an empty TILELANG_CACHE_DIR), so a"
                        " JIT process using that cache runs exactly these cubins")
    b.set_defaults(subparser=b)

    v = aot_sub.add_parser("verify", help="check a build folder against its manifest (hashes, files, barrier check)")
    v.add_argument("dir")
    v.add_argument("--json", action="store_true", help="print the manifest summary as JSON")
    v.set_defaults(subparser=v)
    return p


def _build(args) -> int:
    from .aot.build import AotBuildError, build
    from .config import ConfigError, resolve_geometry
    from .kernels import registry
    from .kernels.tl import DEFAULT_ARCH, TileLangUnavailable
    from .validate import FoldKvInputError

    misuse = args.subparser.error  # prints usage + "error: ..." and exits 2
    if args.arch != DEFAULT_ARCH:  # the builders would compile for DEFAULT_ARCH first and the build refuse afterwards
        misuse(f"argument --arch: the kernel builders generate for {DEFAULT_ARCH}; to build for {args.arch}, set"
               f" FOLDKV_CUDA_ARCH={args.arch}")
    try:
        geometry = resolve_geometry(args.geometry)
    except ConfigError as exc:
        misuse(f"argument --geometry: {exc}")
    variants = None
    if args.only:
        try:
            variants = [registry.get(n) for n in args.only]
        except KeyError as exc:
            misuse(f"argument --only: {exc.args[0]}")
    try:
        manifest = build(args.out, arch=args.arch, geometry=geometry, variants=variants,
                         log=lambda s: print(s, file=sys.stderr), fill_tilelang_cache=args.fill_tilelang_cache)
    except (AotBuildError, TileLangUnavailable, ConfigError, FoldKvInputError) as exc:
        print(f"aot build failed: {exc}", file=sys.stderr)
        return 1
    print(f"{len(manifest['kernels'])} kernels for {manifest['arch']} ({', '.join(manifest['formats']) or 'no format'})"
          f" in {args.out}")
    return 0


def _verify(args) -> int:
    from .aot.verify import AotVerifyError, summary, verify

    if not os.path.isdir(args.dir):
        what = "a file" if os.path.exists(args.dir) else "no such path"
        args.subparser.error(f"argument dir: {args.dir!r} is not a build folder ({what})")
    try:
        manifest = verify(args.dir)
    except AotVerifyError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    s = summary(manifest)
    print(json.dumps(s, indent=1) if args.json else f"ok: {len(s['kernels'])} kernels match the manifest in {args.dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {"build": _build, "verify": _verify}[args.aot_command](args)


if __name__ == "__main__":
    sys.exit(main())
