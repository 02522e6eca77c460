"""The benchmark's own Django app: the rows of the ``fenced-save`` workloads."""
