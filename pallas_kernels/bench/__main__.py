import importlib
import sys

OPS = ("qmm", "gdn", "attention")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in OPS:
        print(f"usage: python -m pallas_kernels.bench {{{','.join(OPS)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(f"pallas_kernels.bench.{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
