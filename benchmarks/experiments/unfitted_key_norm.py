"""m3c with passes.index_init.UNFITTED_KEY_NORM set (the random key rows of an index head wider than the dense
channels it is fitted from, as a share of the fitted rows' mean norm), to compare inits of a wide index head.

    python benchmarks/experiments/unfitted_key_norm.py NORM convert SRC OUT --index-dim 128 ...
"""
import sys

from m3compile.cli import main
from m3compile.passes import index_init

if __name__ == "__main__":
    index_init.UNFITTED_KEY_NORM = float(sys.argv[1])
    main(sys.argv[2:], prog_name="m3c")
