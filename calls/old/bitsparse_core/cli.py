"""Command line: ``bitsparse`` (also ``python -m bitsparse_core``).

``bitsparse demo``          pack ReLU-like tensors, check round trips and sizes, train a
                            small FFN dense and packed (``--json`` for a machine-readable report)
``bitsparse inspect FILE``  validate a serialized buffer (docs/format.md) and print its header
``bitsparse --version``
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_INVALID = 1   # demo: a mismatch; inspect: the buffer breaks a rule of the spec
EXIT_USAGE = 2     # bad options, unreadable file, unavailable backend (argparse's code)


def _version() -> str:
    from . import __version__
    from .spec.format import VERSION
    return f"bitsparse_core {__version__} (format v{VERSION})"


def _csv(kind):
    def parse(text: str) -> list:
        try:
            items = [kind(t) for t in text.split(",") if t.strip()]
        except (ValueError, TypeError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        return items
    return parse


def _sparsity(text: str) -> float:
    s = float(text)
    if not 0.0 <= s <= 1.0:
        raise ValueError(f"sparsity {s} is outside [0, 1]")
    return s


def _dtype(text: str):
    from . import dtypes
    try:
        return dtypes.resolve(text.strip())
    except dtypes.UnsupportedDTypeError as exc:
        raise ValueError(str(exc)) from None


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is not a positive integer")
    return n


def _parser() -> argparse.ArgumentParser:
    from .demo import DTYPES, SPARSITIES
    from .spec.format import Encoding

    parser = argparse.ArgumentParser(prog="bitsparse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="pack ReLU-like tensors, check round trips, show ratios")
    demo.add_argument("--numel", type=_positive, default=None,
                      help="elements per tensor (default 2^24 on a GPU backend, 2^20 on numpy)")
    demo.add_argument("--dtypes", type=_csv(_dtype), default=list(DTYPES),
                      help="comma-separated dtypes (default: all five: "
                           + ",".join(d.name for d in DTYPES) + ")")
    demo.add_argument("--sparsities", type=_csv(_sparsity), default=list(SPARSITIES),
                      help="comma-separated fractions of zeros (default: "
                           + ",".join(map(str, SPARSITIES)) + ")")
    demo.add_argument("--encoding", default="nosign",
                      choices=[e.name.lower() for e in Encoding] + ["auto"])
    demo.add_argument("--backend", default="auto",
                      help="auto (a GPU backend when one is available, else numpy), numpy, "
                           "cupy or numba")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--repeats", type=_positive, default=None,
                      help="timed repeats per case (default 10 on a GPU, 1 on the CPU)")
    demo.add_argument("--no-training", action="store_true",
                      help="skip the PyTorch training comparison")
    demo.add_argument("--steps", type=_positive, default=None,
                      help="training steps per variant (default 12 on the CPU, 6 on a GPU)")
    demo.add_argument("--threads", type=int, default=1,
                      help="torch intra-op threads for the CPU training comparison "
                           "(default 1; 0 keeps torch's default)")
    demo.add_argument("--json", action="store_true",
                      help="print one JSON document instead of the tables")

    insp = sub.add_parser("inspect", help="validate a serialized buffer and print its header")
    insp.add_argument("file", help="a file holding one format-v1 buffer ('-': standard input)")
    insp.add_argument("--json", action="store_true", help="print the header as JSON")
    return parser


# ------------------------------------------------------------------------ demo
def _demo(args, parser) -> int:
    from . import backend_available, registered_backends
    from . import demo

    if args.backend != "auto":
        if args.backend not in registered_backends():
            parser.error(f"--backend {args.backend!r}: use auto or one of "
                         f"{', '.join(registered_backends())}")
        if not backend_available(args.backend):
            print(f"bitsparse demo: backend {args.backend!r} is not available here",
                  file=sys.stderr)
            return EXIT_USAGE
        if args.backend != "numpy":
            try:
                import cupy  # noqa: F401  (the demo moves GPU data with CuPy)
            except ImportError:
                print("bitsparse demo: the GPU demo moves data with CuPy; install "
                      "bitsparse_core[cuda12] or [cuda13]", file=sys.stderr)
                return EXIT_USAGE
    backend = demo.pick_backend() if args.backend == "auto" else args.backend
    numel = args.numel or demo.default_numel(backend)
    backend, rows = demo.codec_table(numel, args.seed, dtypes=args.dtypes,
                                     sparsities=args.sparsities, backend=backend,
                                     encoding=args.encoding, repeats=args.repeats,
                                     progress=not args.json)
    training, skipped = (None, "--no-training") if args.no_training else \
        demo.training_comparison(steps=args.steps, threads=args.threads)
    ok = demo.codec_ok(rows) and demo.training_ok(training)
    if args.json:
        report = dict(version=_version(), backend=backend, numel=numel, codec=rows,
                      training=training, training_skipped=skipped, ok=ok)
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        demo.print_codec_table(backend, numel, rows)
        if training is not None:
            demo.print_training(training)
        else:
            print(f"\n(training comparison skipped: {skipped})")
    return 0 if ok else EXIT_INVALID


# --------------------------------------------------------------------- inspect
def describe(buf) -> dict:
    """Validate ``buf`` (every rule of docs/format.md) and describe its header.

    Raises the named :class:`bitsparse_core.FormatError` of the first broken rule.
    """
    from .spec.format import VERSION, layout
    from .spec.serialize import validate

    h = validate(buf)
    lay = layout(h.shape, h.dtype, h.encoding, h.capacity, h.chunk_log2)
    dense = h.numel * h.dtype.itemsize
    return dict(format_version=VERSION, shape=list(h.shape), dtype=h.dtype.name,
                encoding=h.encoding.name.lower(), chunk_log2=h.chunk_log2, numel=h.numel,
                nnz=h.nnz, capacity=h.capacity, density=h.nnz / h.numel if h.numel else 0.0,
                header_size=h.header_size,
                sections={name: dict(offset=off, length=length)
                          for name, (off, length) in lay.sections.items()},
                offset_width=lay.offset_width, total_size=h.total_size, dense_size=dense,
                ratio=dense / h.total_size, checksum=f"{h.checksum:#010x}")


def _print_description(name: str, d: dict) -> None:
    shape = "(" + ", ".join(map(str, d["shape"])) + ("," if len(d["shape"]) == 1 else "") + ")"
    rows = [
        ("file", f"{name}: a valid format-v{d['format_version']} buffer "
                 f"(every rule of docs/format.md §8 holds)"),
        ("shape", f"{shape}, {d['numel']:,} elements"),
        ("dtype", d["dtype"]),
        ("encoding", d["encoding"]),
        ("chunk_log2", f"{d['chunk_log2']} ({1 << d['chunk_log2']:,} elements per chunk, "
                       f"{d['offset_width'] * 8}-bit offsets)"),
        ("nnz", f"{d['nnz']:,} ({100 * d['density']:.2f} % of the elements)"),
        ("capacity", f"{d['capacity']:,}"),
        ("header", f"{d['header_size']:,} B"),
    ]
    rows += [(name_, f"{s['length']:,} B at offset {s['offset']:,}")
             for name_, s in d["sections"].items()]
    rows += [("total", f"{d['total_size']:,} B (dense {d['dense_size']:,} B)"),
             ("ratio", f"{d['ratio']:.2f}x (dense / packed)"),
             ("checksum", f"{d['checksum']} (CRC-32)")]
    for key, value in rows:
        print(f"{key + ':':<12}{value}")


def _inspect(args) -> int:
    from .errors import FormatError

    name = "<stdin>" if args.file == "-" else args.file
    try:
        if args.file == "-":
            buf = sys.stdin.buffer.read()
        else:
            with open(args.file, "rb") as f:
                buf = f.read()
    except OSError as exc:
        print(f"bitsparse inspect: cannot read {name}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        d = describe(buf)
    except FormatError as exc:
        print(f"bitsparse inspect: {name}: invalid buffer: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return EXIT_INVALID
    if args.json:
        json.dump(dict(file=name, valid=True, **d), sys.stdout, indent=1)
        print()
    else:
        _print_description(name, d)
    return 0


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        return _demo(args, parser)
    return _inspect(args)
