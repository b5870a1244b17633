"""A discrete-event simulator of the serving cluster that drives the same policy objects as the
live system: the autoscaler's policies, the placement scheduler and the KeysManager's cache rule."""
