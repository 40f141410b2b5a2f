"""The policy simulator: synthetic traces (workloads) and production trace files (traces),
replay against the daemon's own policy classes and Belady's MIN, counting block hits and the
prefix hits an engine gets (replay), a table and an SVG plot (report). `kvcached sim` runs it."""
