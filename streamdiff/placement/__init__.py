"""Adaptive placement: band weights of a VAE group (bands.py), the profiler (profile.py), a
layout and its mapping to the config (layout.py), the pipeline simulator (sim.py) charging
a profile's service times (costs.py), and the layout planner (planner.py)."""
