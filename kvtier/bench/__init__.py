"""`kvtier bench`: replay a multi-turn trace with idle gaps and report TTFT split by residency.

`trace` builds the workload (generator, kvtier JSONL, public Mooncake traces), `run` drives
the engine in real time, `report` turns per-request records into tables, JSON and HTML.
"""
