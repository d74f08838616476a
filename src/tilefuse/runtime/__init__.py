"""Runtime: compiled graphs (buffers, launches, extern calls) and what runs them; the disk cache
is below every layer (`tilefuse.cache`)."""
