"""Correctness tooling: the fp64 comparison rule, verify-mode bisection, failure reports and
reproducers, the differential fuzzer and its shrinker, and the OpInfo sweep.

By the layering rule only the CLI and the public API import this package; it may import
anything below it.
"""
