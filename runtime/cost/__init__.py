"""The step-cost model and draft-length optimiser, and `specpipe profile`'s measurements that calibrate it."""
