"""Cluster-scale replay of routing traces through the cost model: the simulator, workloads, roofline, traces."""
