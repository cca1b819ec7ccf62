"""A SimPy simulator of strata's scheduler (DESIGN.md sections 3, 5, 6; docs/SIMULATOR.md).

An independent implementation of the scheduling rules of docs/SCHEDULING.md: arrivals and
admission, prefill chunks and the decode_share rule, the rotation ring, group sizing, the graph
cache with its memory budget, acceptance and commits. `strata.trace` is the only strata module
it imports.

- `sim.replay.replay_trace(events)`: reproduce an engine trace event by event.
- `sim.predict.run_predict(cfg, out_dir)`: simulate a workload from a cost profile.
- `sim.profile.fit_profile(traces)`: fit a cost profile from engine traces.
- `python -m sim mode=replay trace=FILE` / `python -m sim mode=predict ...`: the Hydra app.
"""
