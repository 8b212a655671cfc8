"""A run from end to end: building its parts, its state and checkpoints, the checks before it starts (preflight,
rehearsal), its folder lock and sweep bookkeeping."""
