"""Tuning: schedule spaces are ranked by a cost model, the survivors are measured by a search
within a time budget, and the winner is cached on disk so that a later process never measures
again. Backend-neutral: measuring is a callable the caller supplies.

``search`` owns the measurement search (a UCB bandit); ``cache`` owns the tuning cache.
"""
