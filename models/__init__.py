"""Models: where a checkpoint comes from, how it is partitioned into stage shards and read back
(streamed, verified), and the code that computes a range of stages (transformers' own modules,
batched; or an emulated profile)."""
