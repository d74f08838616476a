"""Correctness tooling: the differential fuzzer and its shrinker, and the OpInfo sweep, judged by
the fp64 rule (`tilefuse.compare`).

By the layering rule only the CLI imports this package; it may import anything below it. What
the public API itself runs — failure reports and reproducers (`tilefuse.failure`), verify mode
(`tilefuse.verify_mode`) — sits with the driver, below the API.
"""
