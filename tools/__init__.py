"""Offline and one-shot commands: the demo, training the CV-attention model, CPU profiling."""
