"""bench.spec_decode's parts: its workloads, the server counters it reads, its report."""
