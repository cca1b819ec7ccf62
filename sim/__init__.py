"""A SimPy simulator of strata's scheduler (DESIGN.md sections 3, 5, 6; docs/SIMULATOR.md).

An independent implementation of the scheduling rules of docs/SCHEDULING.md: arrivals and
admission, prefill chunks and the decode_share rule, the rotation ring, group sizing, the graph
cache with its memory budget, acceptance and commits, and the expert cache (which experts each
forward routes to, hits, misses and the adaptive swap: `sim.experts`, `sim.expert_costs`). `strata.trace` is the only strata module
the simulator imports; `sim.engine_runs` (used by `python -m sim calibrate` and the GPU check
scripts only) runs the real engine, since it measures it.

- `sim.replay.replay_trace(events)`: reproduce an engine trace event by event.
- `sim.predict.run_predict(cfg, out_dir)`: simulate a workload from a cost profile.
- `sim.profile.fit_profile(traces)`: fit a cost profile from engine traces.
- `sim.spread.prediction_range(...)`: a prediction's range from the profile's run speeds.
- `sim.calibrate.calibrate(opts)`: measure this machine quickly, write a hardware preset.
- `python -m sim mode=replay trace=FILE` / `python -m sim mode=predict ...`: the Hydra app;
  `python -m sim calibrate device=cuda`.
"""
