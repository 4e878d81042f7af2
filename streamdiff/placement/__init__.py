"""Adaptive placement: band weights of a VAE group (bands.py), the profiler (profile.py), the
pipeline simulator (sim.py) and the layout planner (planner.py)."""
