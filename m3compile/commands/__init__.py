"""The command line's groups of subcommands, beside cli.py (which holds the group `m3c` and the pipeline's commands).

    eval.py    `m3c eval loss | retrieval | ruler`
    train.py   `m3c distill`, `m3c train` (their shared options, progress bar and summary)
    bench.py   `m3c bench kernels | model | distill | backward | vision`
    common.py  what they share: the one-line error, the console, lengths and lists, the --kv-cache option
"""
