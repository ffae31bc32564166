"""What a running or profiled job tells the planner back: the cost model recalibrated from
measured steps (recalibrate), a live re-split of the batch (rebalance) and the micro-batch
sizes a plan needs measured (measured_sizes).
It may import `cost` and `search`; never `outputs`."""
