"""The policy simulator: synthetic traces (workloads), replay against the daemon's own policy
classes and Belady's MIN (replay), a table and an SVG plot (report). `kvcached sim` runs it."""
