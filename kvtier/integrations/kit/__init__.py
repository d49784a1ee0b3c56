"""What every engine's client of the tier needs, with no engine imported: combining the
results of tensor-parallel ranks (`ranks.py`) and sizing each rank's share (`parallel.py`),
sliding-window groups (`groups.py`), the weights identity (`identity.py`) and its epochs
(`epochs.py`), counters (`counters.py`), per-request state and the wake timeline
(`request_state.py`, `wake_timeline.py`), the hook clock (`hook_clock.py`), and KV events for
routers (`events.py`). `../vllm/` and `../sglang/` hold only each engine's glue."""
