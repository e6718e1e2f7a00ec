"""FLStore on lifl: what a job retains after its rounds (``retention``) and the non-training
workloads its queries run over it (``workloads``)."""
