"""Adaptive placement: band weights of a VAE group (bands.py), the profiler (profile/), the
pipeline simulator (sim.py) and the layout planner (planner.py)."""
