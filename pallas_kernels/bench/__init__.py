"""Benchmarks for the kernels, run on the GPU: `python -m pallas_kernels.bench {qmm,gdn,attention} [...]`.

Each op has its own module here with a `main(argv)`; timings are printed as a table and never asserted.
"""
