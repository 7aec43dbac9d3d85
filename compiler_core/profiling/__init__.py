"""Profiling: the PMU catalogue, stats buffer layouts, the runtime's stats writer and opstats.

The loop mirrors the vendor's: the compiler lays out stats buffers by `-stats-level` and records
the layout in `statsdesc.bin`; the runtime fills them from the cost model's timeline and writes
one raw buffer per inference; `opstats` turns raw buffers into per-operator tables and a trace.
"""
