"""The profiler: what each stage costs on these devices (`streamdiffd profile`, and at start when
the planner has no fresh profile for this device kind, model and size).

Every figure is measured by the engines the workers run, in processes pinned as the workers
are (a CPU "device" is a core per thread), one measurement at a time so none competes:

- DiT: a shot's first block (prompt encoding, the first block's steps) and steady blocks, alone
  and per block in batches of 2 and 4 sessions; on the CPU also beside the host's work per
  block (the supervisor encodes on the DiT workers' cores);
- VAE: the same, whole height (k = 1), and each decoder stage's own time (what a cut between
  stages moves to the DiT, topology.vae_cut);
- VAE groups of k = 2 .. min(devices, 4) shards over the real collective (gloo, nccl, xccl): the
  group's time per block, each shard's own work and its waits for neighbours, with equal bands
  and, for k = 2, with a 1:3 split, so a shard's cost is known as front + rows x per-row cost;
- on the CPU, the DiT and VAE at 2 threads (the aggregated layouts give a worker two cores);
- on the CPU, the hybrid probe: a DiT at low priority beside shard 0 of a decoding 2-way group,
  its own time per block there (sharing a core costs more than its work alone);
- DiT groups of g = 2 .. min(devices, 4, heads) ranks (Ulysses, parallel/dit_group.py) over the
  real collective: rank 0's time per block, alone and in batches of 2, its own work and its time
  inside the all-to-alls (the link's cost, and what the planner weighs against 1/g of the work);
- the encoder (libx264) per block.

The result is plain JSON (`Profile.to_json`); `docs/results/profile-cpu.json` is this project's CPU.

The package's rooms: `schema` (the Profile, its cache and what the planner reads of it),
`harness` (the children's plumbing: one process per probe, pinned as a worker is), `probes`
(the DiT, VAE, host and encoder probes on any device), `cpu_probes` (the CPU's own: the
interleaved thread levels and the hybrid probe) and `measure` (a round of probes, and rounds).
"""
