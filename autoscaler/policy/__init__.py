"""Pure scaling policies: observed state in, decision out, no I/O."""
