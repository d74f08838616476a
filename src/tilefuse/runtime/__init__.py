"""Runtime: compiled graphs (buffers, launches, extern calls) and the on-disk cache."""
