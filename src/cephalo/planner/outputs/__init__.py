"""What a solved Plan looks like to a person: the plan's table, choices and baselines as
`cephalo plan` and `cephalo run` print them (report).
It may import `cost` and `search`; never `feedback`."""
