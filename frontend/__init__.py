"""The entry side: the entry function's HTTP surface (native and OpenAI), its admission control,
and the client that drives a request through the stages."""
