"""The benchmarks: one module per question, each a small set of cases over the library's public
entry points, sharing ``harness.py`` (devices, interleaved repeats, tables, stamped JSON).

    python benchmarks/bench_step.py [args]        # each runnable as a script
    python benchmarks/bench_step.py --smoke       # tiny sizes: what tests/test_benchmarks.py runs
"""
