"""The stage engine: a stage replica's loop, its transport over Redis, its routes, the
continuous-batching step with its KV caches, and the watchdog that serves a function's handler."""
