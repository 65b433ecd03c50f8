"""Training the draft (in-process or as a torchrun worker) and the named checks of its export."""
