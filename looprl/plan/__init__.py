"""`looprl plan`: a run's peak memory, predicted from configs before any weight is loaded."""
