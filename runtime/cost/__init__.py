"""The step-cost model (costmodel), the draft-length optimiser over it (draft_length), what `tune` prices and the
limits it derives (tuning), and `specpipe profile`'s measurements that calibrate it (profile, measure, calibrate)."""
