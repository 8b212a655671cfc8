"""Checks that a run is sound: models and data can be found (hub), the generator samples what the trainer scores
(parity), the generator holds the weights the trainer pushed (weight sync)."""
